"""Batch-1 linear layers on CUDA: a Triton GEMV that streams the weight at full bandwidth.

At batch 1 a decode step is a chain of matrix-vector products over weights of 4–12 MB per
layer, and cuBLAS picks GEMM tilings for them that reach about 1 TB/s on an H200 (a
profile of the Qwen3-0.6B shape: 29 µs per layer in GEMVs, 2/3 of the step). Here each
program owns BLOCK_N output rows and reads their whole K extent in wide vector loads, so
every SM has many bytes in flight and no split-K reduce is needed.

The same kernel reads int8 and fp8 (e4m3) weights with a scale per output row
(nanoinfer.quantized's Int8Weight, Fp8Weight): each weight is widened to fp32 in registers,
so a batch-1 step reads one byte per weight instead of two.

`linear(x, w, b)` is what the model calls on CUDA: this kernel for one row, otherwise
F.linear for a dense weight, and for a quantized one `quantized.linear` (fp8: activations
per token in e4m3 and `torch._scaled_mm`). The kernel is a torch custom op, so torch.compile
keeps it inside a compiled graph as one opaque call (the way it keeps a cuBLAS call) and
CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from nanoinfer import quantized
from nanoinfer.quantized import Fp8Weight, Int8Weight


def _quick_bench(kernel_call, quantiles):
    # A GEMV takes microseconds: 20 ms of repeats rank the configs as well as Triton's default
    # 100 ms, and a start autotunes each projection shape of the model in a quarter of the time.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# cache_results: the winners go to Triton's cache directory, so a second start skips tuning.
@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for n, k, w, s in ((4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 512, 8, 3), (16, 256, 4, 3),
                                (32, 256, 8, 3), (8, 2048, 8, 3), (16, 1024, 8, 3), (32, 512, 8, 3), (64, 256, 8, 3),
                                # few rows, long rows: the best for 8B shapes, 1-byte weights most of all
                                # (an H100 sweep: .scratch-era numbers in bench/RESULTS.md)
                                (2, 4096, 4, 3), (2, 2048, 4, 4), (4, 2048, 4, 4))],
    key=["N", "K", "W_BYTES"], do_bench=_quick_bench, cache_results=True,
)
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, N, K, stride_wn, W_BYTES, HAS_SCALE: tl.constexpr,
                 INT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # W_BYTES (the weight's element size) only keys the tuning: 1-byte weights want wider tiles.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        if INT8:
            # int8 -> fp32 without I2F (an eighth of the FMA rate on Hopper: it made the kernel
            # instruction-bound): q + 128 in [0, 255] added to the bits of 2^23 is the float
            # 2^23 + q + 128, exactly; one float subtraction leaves q.
            wf = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        else:
            wf = w.to(tl.float32)
        acc += wf * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_SCALE:
        out *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@torch.library.custom_op("nanoinfer::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ (w[N, K] * scale[N, None]).T -> [1, N] in x's dtype, fp32 accumulation
    (`scale`: a quantized weight's per-row scale; None for a dense one)."""
    n, k = w.shape
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x, w, w if scale is None else scale, out, n, k, w.stride(0), w.element_size(), HAS_SCALE=scale is not None,
        INT8=w.dtype == torch.int8)
    return out


@gemv.register_fake
def _(x, w, scale=None):
    return x.new_empty((x.shape[0], w.shape[0]))


def linear(x: torch.Tensor, w: quantized.Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized.linear` (F.linear for a dense weight), through the Triton GEMV for a single
    row of a CUDA tensor."""
    if x.shape[0] != 1 or not x.is_cuda:
        return quantized.linear(x, w, b)
    if isinstance(w, (Int8Weight, Fp8Weight)):
        out = gemv(x, w.q, w.scale)
    elif isinstance(w, torch.Tensor) and w.stride(1) == 1:
        out = gemv(x, w)
    else:
        return quantized.linear(x, w, b)
    return out if b is None else out + b
