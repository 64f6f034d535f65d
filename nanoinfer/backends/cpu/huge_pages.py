"""Weights the CPU kernels stream, moved into memory that Linux backs with 2 MiB pages.

A decode step reads every packed weight once, ~700 MB a token on a 1B model's Q4_K_M file.
In 4 KiB pages that is ~175,000 pages, far past what the TLB holds (Zen 4's 3,072 second-level
entries cover 12 MB), so the stream pays a page-table walk every 4 KiB. Linux's transparent huge
pages back an anonymous mapping with 2 MiB pages where the mapping is advised so before it is
first touched (MADV_HUGEPAGE; the common setting of /sys/kernel/mm/transparent_hugepage/enabled
is `madvise`, and torch's own allocations are not advised). On a 2-core Zen 4 a 700 MB
`torch.sum` read 31-33 -> 36-37 GB/s and a Q4_K_M decode ran 4-7% faster (bench/RESULTS.md).

Only the advice changes, never the bytes: where it is not taken (another OS, THP `never`, a
kernel without it) the copy is an ordinary one, and the kernels read it the same.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # (None where the OS has no transparent huge pages)


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values (a contiguous CPU tensor) in a new tensor whose whole 2 MiB pages are advised to be
    huge pages; `t` itself where that cannot help: smaller than one huge page, not on the CPU, or no advice.

    The new tensor views a mapping of its own, one huge page longer so that its start can be aligned to one.
    Its own mapping, not torch's allocator: reused heap memory would already be backed by small pages (the
    advice only applies to pages not yet touched) and the alignment's slack would be resident; here the
    slack is never touched. The mapping lives as long as the tensor (torch.frombuffer holds it)."""
    size = t.numel() * t.element_size()
    if ADVICE is None or t.device.type != "cpu" or size < HUGE_PAGE or not t.is_contiguous():
        return t
    # (private: a shared mapping, mmap's default, is shmem, which follows THP's shmem_enabled, most often never)
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(ADVICE, offset, size // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # (a kernel built without them: plain pages, the same bytes)
        pass
    return raw[offset:offset + size].view(t.dtype).view(t.shape).copy_(t)
