"""What this machine runs, a line each (`nanoinfer env`): versions, the CPU and its SIMD features, the chosen kernels.

A bug report pastes these lines: CPU results differ by ISA tier (AVX2, AVX-512 VNNI, NEON), so
the report says which tier the packed matmuls were built for, as the log line at start does.
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from pathlib import Path

# The CPU features that pick a kernel tier (x86's and ARM's names in /proc/cpuinfo).
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "asimd", "asimddp", "i8mm", "sve")


def cpu_model_and_flags(cpuinfo: str) -> tuple[str, list[str]]:
    """The CPU's model name and which of SIMD_FLAGS it has, from /proc/cpuinfo's text."""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model in (platform.processor(), platform.machine()):
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return model, [f for f in SIMD_FLAGS if f in flags]


def report() -> list[str]:
    """The lines `nanoinfer env` prints (builds cpu_native.c on a machine's first call: about a second)."""
    import torch

    from nanoinfer.backends.cpu import cpu_native

    try:
        version = metadata.version("nanoinfer")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model, flags = cpu_model_and_flags(cpuinfo)
    cuda = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none"
    return [f"nanoinfer {version}",
            f"python {platform.python_version()} ({sys.platform}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} CPU threads",
            f"cpu: {model} ({platform.machine()}); SIMD: {' '.join(flags) or 'none of ' + ' '.join(SIMD_FLAGS)}",
            f"cpu kernels: {cpu_native.describe(cpu_native.library())}",
            f"cuda: {cuda}"]
