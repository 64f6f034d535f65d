"""nanoinfer.backends.cuda.peer_sum's kernels: projections that push their outputs into every rank's slot, then
a pull per rank, give each rank the sum of the ranks' products, step after step in alternating
slots (whose words' flags alternate with each use).

The ranks here are buffers of one process (their addresses given to `PeerLinks.attach` as a
rendezvous would give the peers'), run one after another: on one CUDA GPU, or on the CPU in
Triton's interpreter (`TRITON_INTERPRET=1 python -m pytest tests/test_peer_sum.py`). Over real
GPUs against NCCL: tests/test_gpu_tensor_parallel.py."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from nanoinfer.backends.cuda import gemv  # noqa: E402
from nanoinfer.backends.cuda.peer_sum import PeerLinks  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="the kernels need CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def one_config(monkeypatch):
    """(The interpreter cannot time configs: one config, nothing tuned.)"""
    if INTERPRET:
        monkeypatch.setattr(gemv._gemv_kernel, "configs",
                            [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)])


def _ranks(size: int, hidden: int) -> list[PeerLinks]:
    links = [PeerLinks(r, size, hidden, torch.bfloat16, torch.device(DEVICE)) for r in range(size)]
    nbytes = PeerLinks(0, size, hidden, torch.bfloat16, torch.device(DEVICE)).nbytes()
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(size)]  # (as connect's)
    for r in range(size):
        links[r].attach(buffers[r], [b.data_ptr() for b in buffers])
    return links


@pytest.mark.parametrize("size", [2, 3])
def test_pushed_rows_pulled_are_the_sum_over_ranks(one_config, size):
    torch.manual_seed(0)
    hidden, k = 96, 64  # (96 rows: the last program of 32-row tiles is full, of 64-row ones not)
    links = _ranks(size, hidden)
    for step in range(3):
        for slot in (0, 1):
            xs = [torch.randn(1, k, dtype=torch.bfloat16, device=DEVICE) for _ in range(size)]
            ws = [torch.randn(hidden, k, dtype=torch.bfloat16, device=DEVICE) for _ in range(size)]
            res = torch.randn(1, hidden, dtype=torch.bfloat16, device=DEVICE)
            # The lead rank adds the residual, as fused_layers has it.
            parts = [gemv.fused_gemv(xs[r], ws[r], None, None, 0.0, False, res if r == 0 else None)
                     for r in range(size)]
            for r in range(size):
                pushed = gemv.fused_gemv(xs[r], ws[r], None, None, 0.0, False, res if r == 0 else None,
                                         links[r].pushes[slot])
                assert pushed is None
            want = sum(p.float() for p in parts).to(torch.bfloat16)
            for r in range(size):
                got = links[r].pull(slot)
                assert got.shape == (1, hidden) and got.dtype == torch.bfloat16
                # fp32 sums in rank order, rounded once (the interpreter truncates where a GPU rounds)
                assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0), (step, slot, r)
                assert INTERPRET or torch.equal(got, want), (step, slot, r)
                uses = links[r].buffer[: links[r].head_bytes()].view(torch.int32)[:2].tolist()
                assert uses == [step + 1, step + slot], "each pull counts its slot's use"
                assert links[r].failures() == 0  # (no word found stale: padding rows included)


def test_a_pull_waits_for_every_word_of_every_rank(one_config):
    """A pull reads a rank's outputs only once every word of its slot carries this use's flag:
    with one word of rank 1's still from the slot's last use it keeps polling, and gives up
    (counting a failure) only after its polls, instead of adding stale outputs."""
    hidden, k = 64, 32
    links = _ranks(2, hidden)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(hidden, k, dtype=torch.bfloat16, device=DEVICE)
    for r in range(2):
        gemv.fused_gemv(x, w, None, None, 0.0, False, None, links[r].pushes[0])
    links[0].pull(0)
    links[1].pull(0)
    assert links[0].failures() == links[1].failures() == 0
    # The slot's second use: rank 0 pushes, rank 1 only partly (its first word keeps the old flag).
    for r in range(2):
        gemv.fused_gemv(x, w, None, None, 0.0, False, None, links[r].pushes[0])
    words = links[0].buffer[links[0].head_bytes():].view(torch.int64)
    words[hidden // 2] = words[hidden // 2] & 0xFFFFFFFF | (1 << 32)  # (rank 1's first word, flag of use 1)
    links[0].pull(0, polls=16)
    assert links[0].failures() == 1
    links[1].pull(0, polls=16)
    assert links[1].failures() == 0



def test_a_process_connects_peer_sums_once(monkeypatch):
    """A second rendezvous in one process hung (torch counts its exchanges per process, and an
    engine's ranks are new processes): once one was made, `connect` refuses at once, naming why."""
    from nanoinfer.backends.cuda import peer_sum

    links = PeerLinks(0, 2, 64, torch.bfloat16, torch.device(DEVICE))
    monkeypatch.setitem(peer_sum._RENDEZVOUS, "made", False)
    assert links.first_in_process()
    monkeypatch.setitem(peer_sum._RENDEZVOUS, "made", True)
    assert not links.first_in_process()
    with pytest.raises(RuntimeError, match="once a process"):
        links.connect("0")
