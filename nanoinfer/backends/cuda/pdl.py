"""Programmatic dependent launch: a decode step's kernels start before the kernel ahead ends.

A batch-1 step is a chain of ~200 small kernels (the GEMVs, RoPE/KV write, attention, the
peer sums' pulls), each waiting for the one before to end and drain before its programs
are scheduled: at every boundary the GPU's bandwidth idles through the last wave's tail
and the next kernel's launch. On Hopper and later a kernel launched with programmatic
dependent launch (Triton's `launch_pdl=True`) may start once every program of the kernel
ahead has signalled (`gdc_launch_dependents`, or ended); it must then wait (`gdc_wait`) for
that kernel to finish, and its memory to be visible, before it reads what that kernel wrote
or writes what that kernel reads. What it does before the wait must touch only what no
kernel of the step writes: a GEMV fetches its first weight tile into L2 there.

The wait is transitive: every kernel launched this way waits before it ends, so a kernel
that has ended was preceded by ended kernels, and a read after the wait sees every write
of the kernels before. A kernel launched without it (a torch op) waits as always. CUDA
graphs capture the launches as programmatic edges.

`enabled(device)` says whether a device's kernels use it: CUDA capability 9.0 or later,
unless NANOINFER_PDL=0 (to compare, or on a driver that refuses it). Triton's interpreter
never does (its kernels run one after another anyway).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

VARIABLE = "NANOINFER_PDL"


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (see above)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(VARIABLE) == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch(device: torch.device) -> dict:
    """A launch's keywords for a kernel with a `PDL` constexpr: `PDL` (the kernel signals and
    waits) and Triton's `launch_pdl` (the launch lets it start early) together, or `PDL` off
    alone (a Triton from before `launch_pdl` never sees it)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def start():
    """A kernel's first step under programmatic dependent launch: let the next kernel's programs
    be scheduled (they wait for this one in their own `start` or `wait`), then wait for the
    kernel before this one."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


@triton.jit
def signal():
    """Let the next kernel's programs be scheduled (`wait` must follow before any read)."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait():
    """Wait for the kernel before this one to end, its writes visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Fetch the 128-byte lines at `ptrs` into L2 (no registers written; never faults: callers
    keep the addresses inside their tensor)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
