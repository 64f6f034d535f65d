"""The written-out 4-bit weight of many-row int4 products (nanoinfer/backends/cuda/int4_gemv.py's `int4_dequantize`)
against the reference, nanoinfer.quant.quantized.dequantize, and `int4_mm` at DEQUANT_ROWS rows against its tile
kernel one row below.

Needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton on the path: the kernel then runs on CPU tensors);
skipped cleanly without them.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from nanoinfer.backends.cuda import int4_gemv  # noqa: E402
from nanoinfer.quant import quantized  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="the Triton kernel needs CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_int4(n: int, k: int, group: int, halves: bool, seed: int) -> quantized.Int4CudaWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    low = -8 * scale if halves else -scale * torch.randint(0, 16, scale.shape, generator=g) * (1 + 2**-13)
    if halves:
        scale, low = scale.half().float(), low.half().float()
    w = quantized.Int4CudaWeight.from_groups(quantized.GroupedWeight(q, scale, low, 4))
    return quantized.map_weight(lambda t: t.to(DEVICE), w)


@pytest.mark.parametrize("n,k,group", [(48, 256, 32), (33, 512, 128), (16, 768, 256), (70, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("halves", [True, False], ids=["fp16_scales", "fp32_scales"])
def test_int4_dequantize_equals_the_reference_rounded_once(n, k, group, dtype, halves):
    w = random_int4(n, k, group, halves, seed=n + k + group)
    got = int4_gemv.int4_dequantize(w.packed, w.scale, w.min, dtype)
    want = quantized.dequantize(w).to(dtype)  # (q scale + min in fp32, one rounding)
    assert got.shape == (n, k) and got.dtype == dtype
    # At most the rounded weight's last bit apart: CUDA may fuse q scale + min into one FMA, and Triton's interpreter
    # rounds fp32 to bf16 by truncation (its fp16 agrees bit for bit).
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=0)


def test_int4_mm_from_dequant_rows_matches_its_tile_kernel():
    """DEQUANT_ROWS rows (cuBLAS over the written-out weight) and, on a GPU, one row fewer (the tile kernel, whose
    tuning the interpreter cannot run): each row as close to the fp32 reference as the other path's, the inputs
    reordered (GPTQ's act-order) taken the same way."""
    n, k, group = 96, 512, 32
    w = random_int4(n, k, group, halves=False, seed=7)
    w = dataclasses.replace(w, cols=torch.randperm(k, generator=torch.Generator().manual_seed(1)).to(DEVICE))
    rows = int4_gemv.DEQUANT_ROWS
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEVICE)
    ref = x.float() @ quantized.dequantize(w).T
    def linear(x):  # (nanoinfer.backends.cuda.linear's call)
        return int4_gemv.int4_mm(x.index_select(1, w.cols), w.packed, w.scale, w.min)

    many = linear(x)
    tol = 2**-6 * ref.abs().max().item()
    assert many.dtype == torch.bfloat16 and many.shape == (rows, n)
    assert torch.allclose(many.float(), ref, rtol=2**-6, atol=tol)
    if DEVICE == "cuda":
        assert torch.allclose(linear(x[:rows - 1]).float(), ref[:rows - 1], rtol=2**-6, atol=tol)
