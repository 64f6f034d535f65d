"""The host heap a CPU engine's steps allocate from: kept between ops, given back at close.

A CPU step allocates each op's output, the quantized copy of its activations and the like (megabytes
at a prompt's tokens) and frees them op by op. glibc's malloc serves an allocation past its mmap
threshold (128 KiB, raised to the largest freed one up to 32 MiB) with fresh pages, and hands the
heap's free top back to the kernel past its trim threshold (twice that): each op's output then
arrives as pages the kernel faults in and zeroes. On a 2-core Xeon a 512-token Q5_K_M prefill spent
8% of its time in that (`clear_page_erms`), and raising both thresholds cut its page faults from
1.23 to 0.44 million and took it from 68 to 74 tok/s (bench/RESULTS.md, issue 62): the freed
buffers are reused, as a caching allocator would. At close, `give_back` returns the heap's free pages
to the kernel (malloc_trim), so a closed engine's memory still goes back (issue 64).

glibc only (Linux): elsewhere both are no-ops. The settings are the process's (malloc has no other
scope); an engine on the CPU sets them when it starts.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # (glibc's malloc.h)
MMAP_FROM = 256 << 20  # allocations below this come from the heap, and are reused once freed
TRIM_FROM = 1 << 30  # the heap's free top kept up to this between ops


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # (musl has mallopt as a stub, and no malloc_trim)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None


def keep_step_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); whether they were set."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, MMAP_FROM) and
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_FROM))


def give_back() -> None:
    """Return the heap's free pages to the kernel (a closed engine's weights and buffers among them)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
