"""The CPU kernels' weights in huge pages (nanoinfer/backends/cpu/huge_pages.py): the same values, aligned to a
huge page and advised as one where Linux can, and the loader's packed forms moved there."""

import sys
from pathlib import Path

import pytest
import torch

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.backends.cpu.huge_pages import ADVICE, HUGE_PAGE, in_huge_pages
from nanoinfer.loaders.params import kquant_form
from nanoinfer.quant import kquants
from nanoinfer.quant.kquants import Q4_K, KQuantWeight

LINUX_THP = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file()


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_a_large_tensor_keeps_its_values_and_starts_on_a_huge_page(dtype):
    t = torch.randint(0, 255, (3 * HUGE_PAGE // 7 + 5, 3), dtype=torch.uint8).to(dtype)  # (not a whole page)
    moved = in_huge_pages(t)
    assert moved.dtype == t.dtype and moved.shape == t.shape and moved.is_contiguous()
    assert torch.equal(moved, t)
    if ADVICE is not None:
        assert moved.data_ptr() != t.data_ptr() and moved.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not LINUX_THP or ADVICE is None, reason="Linux with transparent huge pages")
def test_the_moved_tensor_is_advised_as_huge_pages():
    moved = in_huge_pages(torch.zeros(2 * HUGE_PAGE, dtype=torch.uint8))
    flags = vm_flags(moved.data_ptr())
    assert "hg" in flags  # (VM_HUGEPAGE: madvise(MADV_HUGEPAGE) took)
    assert "sh" not in flags  # (a shared mapping is shmem, which THP's usual settings leave in small pages)


def test_small_noncontiguous_or_device_less_tensors_stay_as_they_are():
    small = torch.zeros(HUGE_PAGE - 1, dtype=torch.uint8)
    assert in_huge_pages(small) is small
    strided = torch.zeros(2, HUGE_PAGE, dtype=torch.uint8)[:, ::2]
    assert in_huge_pages(strided) is strided
    meta = torch.empty(2 * HUGE_PAGE, dtype=torch.uint8, device="meta")
    assert in_huge_pages(meta) is meta


@pytest.mark.skipif(not cpu_native.has_block_matmul(cpu_native.library()), reason="cpu_native does not build here")
def test_the_loader_moves_a_k_quant_matrix_the_kernels_stream():
    """kquant_form's matrix (the kernels' layout) in huge pages: the same bytes in the same layout."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 1024, 4096  # (2.25 MiB of Q4_K)
    data = torch.randint(0, 255, (rows, cols // 256 * kquants.BLOCK_BYTES[Q4_K]), dtype=torch.uint8, generator=g)
    w = KQuantWeight(data, Q4_K, cols)
    formed = kquant_form(w, torch.device("cpu"), torch.float32)
    if ADVICE is not None:
        assert formed.data.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(kquants.file_layout(formed).data, data)
