"""The linear layer the model calls on CUDA: each weight type and row count to its kernel.

`linear(x, w, b)` is what the model calls on CUDA: these kernels up to 16 rows, otherwise
F.linear for a dense weight, and for a quantized one `quantized.linear` (fp8: activations
per token in e4m3 and `torch._scaled_mm`). They are plain functions, not torch custom ops:
nothing compiles around them (calling a custom op imports Dynamo, seconds of a start), and
CUDA graphs capture their launches.
"""

from __future__ import annotations

import torch

from nanoinfer.backends.cuda.gemv import gemv
from nanoinfer.backends.cuda.int4_gemv import int4_kernels_take, int4_mm
from nanoinfer.backends.cuda.row_kernels import quantize_rows_fp8
from nanoinfer.quant import quantized
from nanoinfer.quant.quantized import Fp8Weight, Int4CudaWeight, Int8Weight


def linear(x: torch.Tensor, w: quantized.Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized.linear` on a CUDA tensor: `gemv` for a dense or int8 weight (its kernels up to
    ROWS_MAX rows, cuBLAS past them), `int4_mm` for a 4-bit one, and for an fp8 weight at one
    row (several keep its per-token activation scaling, quantized.fp8_matmul, the scaling in
    one kernel of nanoinfer.backends.cuda.row_kernels)."""
    if not x.is_cuda or x.dim() != 2:
        return quantized.linear(x, w, b)
    if isinstance(w, Int8Weight) or isinstance(w, Fp8Weight) and x.shape[0] == 1:
        out = gemv(x, w.q, w.scale)
    elif isinstance(w, Fp8Weight):
        out = quantized.fp8_matmul(x.contiguous(), w, quantize_rows_fp8)
    elif isinstance(w, Int4CudaWeight) and x.dtype in (torch.bfloat16, torch.float16) and int4_kernels_take(w):
        out = int4_mm(x if w.cols is None else x.index_select(1, w.cols), w.packed, w.scale, w.min)
    elif isinstance(w, torch.Tensor) and w.stride(1) == 1:
        out = gemv(x, w)
    else:
        return quantized.linear(x, w, b)
    return out if b is None else out + b
