"""Batch-1 linear layers on CUDA: a Triton GEMV that streams the weight at full bandwidth.

At batch 1 a decode step is a chain of matrix-vector products over weights of 4–12 MB per
layer, and cuBLAS picks GEMM tilings for them that reach about 1 TB/s on an H200 (a
profile of the Qwen3-0.6B shape: 29 µs per layer in GEMVs, 2/3 of the step). Here each
program owns BLOCK_N output rows and reads their whole K extent in wide vector loads, so
every SM has many bytes in flight and no split-K reduce is needed.

`linear(x, w, b)` is what the model calls: this kernel for one row on CUDA, F.linear
otherwise. The kernel is a torch custom op, so torch.compile keeps it inside a compiled
graph as one opaque call (the way it keeps a cuBLAS call) and CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing


def _quick_bench(kernel_call, quantiles):
    # A GEMV takes microseconds: 20 ms of repeats rank the configs as well as Triton's default
    # 100 ms, and a start autotunes each projection shape of the model in a quarter of the time.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# cache_results: the winners go to Triton's cache directory, so a second start skips tuning.
@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
             for n, k, w in ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 8), (16, 256, 4), (32, 256, 8),
                             (8, 2048, 8), (16, 1024, 8), (32, 512, 8), (64, 256, 8))],
    key=["N", "K"], do_bench=_quick_bench, cache_results=True,
)
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=n_mask)


@torch.library.custom_op("nanoinfer::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ w[N, K].T -> [1, N] in x's dtype, fp32 accumulation."""
    n, k = w.shape
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, w, out, n, k, w.stride(0))
    return out


@gemv.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the Triton GEMV for a single row of a CUDA tensor."""
    if x.shape[0] != 1 or not x.is_cuda or w.stride(1) != 1:
        return F.linear(x, w, b)
    out = gemv(x, w)
    return out if b is None else out + b
