"""The CPU engine's host heap (runtime/executor/host_heap.py): an op's freed buffer is reused by the next op without
fresh page faults, and a closed engine's free heap goes back to the kernel."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# Ten steps of a prefill's kinds of buffers (a 512-token activation, its bf16 copy, a widened weight, an MLP-wide
# output), after three to warm up: the page faults of the ten, in a fresh process, with or without the engine's
# settings.
PROGRAM = textwrap.dedent("""
    import resource, sys, torch
    from runtime.executor import host_heap
    if sys.argv[1] == "kept":
        assert host_heap.keep_step_buffers()
    x = torch.ones(512, 2048)
    w = torch.ones(8192, 2048, dtype=torch.bfloat16)
    def step():
        h = (x * 2).to(torch.bfloat16)
        up = h.float() @ w.float()[:64].T
        return (torch.ones(512, 8192) + up.sum()).to(torch.bfloat16).sum()
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_freed_step_buffers_are_reused_without_page_faults():
    default, kept = _faults("default"), _faults("kept")
    # (on this project's Debian glibc 2.36: 185,000-238,000 against 8,000-16,000; the rest are the kernel's own, and
    # glibc's memalign leaving a freed chunk a few bytes short of the next request)
    assert kept < default / 4, (default, kept)


def test_give_back_returns_the_free_heap():
    from runtime.executor import host_heap

    host_heap.give_back()  # (no error, and idempotent)
    host_heap.give_back()
