"""The one-row GEMV and the 2-16-row kernel on CUDA, for bf16, int8 and fp8 weights: Triton kernels that stream
the weight at full bandwidth.

At batch 1 a decode step is a chain of matrix-vector products over weights of 4–12 MB per
layer, and cuBLAS picks GEMM tilings for them that reach about 1 TB/s on an H200 (a
profile of the Qwen3-0.6B shape: 29 µs per layer in GEMVs, 2/3 of the step). Here each
program owns BLOCK_N output rows and reads their whole K extent in wide vector loads, so
every SM has many bytes in flight and no split-K reduce is needed.

The same kernel reads int8 and fp8 (e4m3) weights with a scale per output row
(nanoinfer.quant.quantized's Int8Weight, Fp8Weight): each weight is widened to fp32 in registers,
so a batch-1 step reads one byte per weight instead of two.

Two to 16 rows (a speculative verify step, a small decode batch) go to a second kernel that
multiplies each weight tile with all the rows at once on tensor cores (rows padded to 16),
so the weight is still read once; two rows of a narrow int8 weight stay in the first kernel.

One row can push its outputs into the tensor-parallel ranks' peer buffers instead of
writing them (`fused_gemv`'s `push`: nanoinfer.backends.cuda.peer_sum), so the sum over ranks needs no
collective kernel.

On Hopper and later the one-row kernel launches early (nanoinfer.backends.cuda.pdl): its programs fetch
their first weight tile into L2 while the kernel ahead finishes, then wait for it.

Their epilogues (SiLU, the residual, RoPE and the KV write) and row mapping are shared with the 4-bit kernels
(nanoinfer.backends.cuda.int4_gemv) in nanoinfer.backends.cuda.gemv_epilogues; the dispatch over all of them is
nanoinfer.backends.cuda.linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda import pdl
from nanoinfer.backends.cuda.gemv_epilogues import (RopeWrite, epilogue, line_elements, program_rows, quick_bench,
                                                    rope_write_epilogue)
from nanoinfer.backends.cuda.peer_sum import Push
from nanoinfer.backends.cuda.tuned_configs import ShippedChoice


# cache_results: the winners go to Triton's cache directory, so a second start skips tuning.
# ShippedChoice: a GPU model with a table in nanoinfer/backends/cuda/tuned/ compiles only the config that won
# there, not every config of each shape (nanoinfer.backends.cuda.tuned_configs; NANOINFER_AUTOTUNE=full tunes).
@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for n, k, w, s in ((4, 1024, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 512, 8, 3), (16, 256, 4, 3),
                                (32, 256, 8, 3), (8, 2048, 8, 3), (16, 1024, 8, 3), (32, 512, 8, 3), (64, 256, 8, 3),
                                # few rows, long rows: the best for 8B shapes, 1-byte weights most of all
                                # (an H100 sweep: .scratch-era numbers in bench/RESULTS.md)
                                (2, 4096, 4, 3), (2, 2048, 4, 4), (4, 2048, 4, 4))],
    key=["N", "K", "W_BYTES", "ROWS", "NORM", "SILU"], do_bench=quick_bench, cache_results=True,
    # (like: a call whose whole key the table lacks takes the choice of the same shape and flags whatever its
    # dtypes: QKV with RoPE in its epilogue, whose key has four more pointers' dtypes, takes the plain QKV
    # product's; an fp16 model takes a bf16 one's, where it tuned every config before)
    prune_configs_by={"early_config_prune": ShippedChoice("_gemv_kernel", like=("N", "K", "W_BYTES", "ROWS", "NORM",
                                                                                "SILU"))},
)
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, N, K, stride_wn, stride_xm, stride_om, W_BYTES, norm_ptr, res_ptr,
                 eps, push_ptr, HAS_SCALE: tl.constexpr, INT8: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr,
                 SILU: tl.constexpr, RESIDUAL: tl.constexpr, PUSH: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, LINE: tl.constexpr = 64, kv_ptr=None,
                 slot_ptr=None, cos_ptr=None, sin_ptr=None, stride_kv=0, NUM_HEADS: tl.constexpr = 0,
                 KV_HEADS: tl.constexpr = 0, HEAD_DIM: tl.constexpr = 0):
    # W_BYTES (the weight's element size) only keys the tuning: 1-byte weights want wider tiles.
    # LINE: the weight's elements in a 128-byte line (`line_elements`), the step of the L2 prefetch.
    # ROWS: 1, or 2 (each weight widened once, multiplied with both rows).
    # One row may fold its neighbours in (fused_gemv): NORM, x is RMSNorm'd on the way in: the
    # norm's gain multiplies x in the loop, which also sums x's squares, and 1 / rms scales the
    # sums at the end (a first pass for the rms would hold every weight load back by the
    # latency of reading x); SILU and RESIDUAL, `epilogue`'s (where the down projection's
    # programs would each recompute SiLU over all of its input).
    offs_n, n_mask = program_rows(N, BLOCK_N, SILU, HEAD_DIM)
    if PDL:  # (nanoinfer.backends.cuda.pdl) the weights are no kernel's output: the first tile into L2 before the wait
        lines = tl.minimum(tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
        pdl.prefetch_l2(w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn + lines[None, :])
        pdl.signal()
        pdl.wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if ROWS == 2:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        if NORM:
            x = x.to(tl.float32)
            squares += x * x
            x = x * tl.load(norm_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if INT8:
            # int8 -> fp32 without I2F (an eighth of the FMA rate on Hopper: it made the kernel
            # instruction-bound): q + 128 in [0, 255] added to the bits of 2^23 is the float
            # 2^23 + q + 128, exactly; one float subtraction leaves q.
            wf = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        else:
            wf = w.to(tl.float32)
        acc += wf * x.to(tl.float32)[None, :]
        if ROWS == 2:
            x2 = tl.load(x_ptr + stride_xm + offs_k, mask=k_mask, other=0.0)
            acc2 += wf * x2.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if NORM:
        out *= tl.rsqrt(tl.sum(squares, 0) / K + eps)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        out *= scale
    if HEAD_DIM > 0:
        rope_write_epilogue(out.to(dtype), N, out_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, stride_kv, BLOCK_N,
                             NUM_HEADS, KV_HEADS, HEAD_DIM)
        return
    out, offs_n, n_mask = epilogue(out, offs_n, n_mask, N, res_ptr, dtype, BLOCK_N, SILU, RESIDUAL)
    if PUSH > 0:  # (one row) into each of PUSH ranks' slots (nanoinfer.backends.cuda.peer_sum's words)
        # A word is two outputs and the flag of this use of the slot (1 or 2, from this rank's
        # count of the slot's uses), stored as one 8-byte store: a rank that reads the flag
        # reads its outputs, with no fence and no count.
        flag = (tl.load(tl.load(push_ptr + PUSH).to(tl.pointer_type(tl.int32))) & 1) + 1
        lo, hi = tl.split(tl.reshape(out.to(dtype), [BLOCK_N // 2, 2]))
        pair = ((lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
                | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16))
        word = (flag.to(tl.int64) << 32) | (pair.to(tl.int64) & 0xFFFFFFFF)
        offs_w = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        for r in tl.static_range(PUSH):
            tl.store(tl.load(push_ptr + r).to(tl.pointer_type(tl.int64)) + offs_w, word, mask=offs_w < N // 2)
    else:
        tl.store(out_ptr + offs_n, out.to(dtype), mask=n_mask)
    if ROWS == 2:
        out2 = tl.sum(acc2, 1)
        if HAS_SCALE:
            out2 *= scale
        tl.store(out_ptr + stride_om + offs_n, out2.to(out_ptr.dtype.element_ty), mask=n_mask)


def _two_rows_on_cuda_cores(w: torch.Tensor) -> bool:
    """Whether a two-row product (a speculative draft's catch-up pass) runs in the one-row kernel,
    each weight widened once for both rows, rather than on tensor cores with rows padded to 16:
    for int8 weights of at most 8,192 output rows, where the tensor-core kernel's few wide
    programs leave SMs idle and widen every weight to bf16 (H100, Llama-3.2-1B shapes, µs:
    3,072 x 2,048 6.0 against 7.2; 2,048 x 8,192 10.6 against 17.5; but 16,384 x 2,048 19.3
    against 15.1, and the 128k-row LM head 130.9 against 93.7). bf16 weights gain nothing
    there (within ±7% either way)."""
    return w.dtype == torch.int8 and w.shape[0] <= 8192


# Up to 16 rows (tl.dot's smallest tile): a speculative verify step (1 + k rows per sequence)
# or a small decode batch reads each weight once, as the one-row kernel does.
ROWS_MAX = 16


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for n, k, w, s in ((16, 256, 4, 3), (16, 512, 4, 3), (16, 1024, 4, 3), (16, 512, 4, 4), (32, 256, 4, 3),
                                (32, 512, 4, 3), (32, 512, 8, 3), (64, 256, 4, 3), (64, 128, 4, 4), (16, 256, 4, 5))],
    key=["N", "K", "W_BYTES"], do_bench=quick_bench, cache_results=True,
    prune_configs_by={"early_config_prune": ShippedChoice("_rows_kernel")},
)
@triton.jit(do_not_specialize=["M"])
def _rows_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, W_BYTES,
                 HAS_SCALE: tl.constexpr, INT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_M: tl.constexpr = 16, res_ptr=0, RESIDUAL: tl.constexpr = False, SILU: tl.constexpr = False):
    # Rows of x padded to 16, one tensor-core product per weight tile: the weight is read once
    # for all rows (cuBLAS picks split-K tilings here that ran 10-40% slower than one row).
    # BLOCK_M (`tiled_matmul`, the deterministic mode's product): a grid axis of row tiles. M is not
    # specialized on: one compiled program for every row count.
    # The deterministic mode's epilogues, each the bits of the unfused kernels after it: RESIDUAL, res [M, N]
    # (out's strides) added to the rounded product; SILU, w is [gate | up] (2 N rows) and out silu(gate) * up.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SILU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(_weight_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn, x.dtype, INT8)), acc)
        if SILU:  # (the up rows' sums: the same steps into their own accumulator)
            acc_up = tl.dot(x, tl.trans(_weight_tile(w_ptr, offs_n + N, offs_k, n_mask, k_mask, stride_wn, x.dtype,
                                                     INT8)), acc_up)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc_up *= tl.load(scale_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    out_at = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SILU:  # (row_kernels' silu_mul on the rounded product: gate and up round, F.silu rounds, the product rounds)
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if RESIDUAL:  # (torch's bf16 add: both in fp32, one rounding)
        acc = acc.to(dtype).to(tl.float32) + tl.load(res_ptr + out_at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_at, acc.to(dtype), mask=mask)


@triton.jit
def _weight_tile(w_ptr, offs_n, offs_k, n_mask, k_mask, stride_wn, dtype: tl.constexpr, INT8: tl.constexpr):
    """Rows offs_n, columns offs_k of a weight, in the activations' dtype."""
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    if INT8:  # (exact: an int8 is a bf16 or fp16; the widening trick of _gemv_kernel)
        return ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(dtype)
    return w.to(dtype)  # (an fp8 weight widens exactly; a no-op for x's own dtype)


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (w[N, K] * scale[N, None]).T -> [M, N] in x's dtype, fp32 accumulation
    (`scale`: a quantized weight's per-row scale; None for a dense one). The row count picks
    the kernel here, at run time."""
    n, k = w.shape
    m = x.shape[0]
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 1 or m == 2 and _two_rows_on_cuda_cores(w):
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            x, w, w if scale is None else scale, out, n, k, w.stride(0), x.stride(0), out.stride(0), w.element_size(),
            x, x, 0.0, x, HAS_SCALE=scale is not None, INT8=w.dtype == torch.int8, ROWS=m, NORM=False, SILU=False,
            RESIDUAL=False, PUSH=0, LINE=line_elements(w), **pdl.launch(x.device))
    elif m <= ROWS_MAX and x.dtype in (torch.bfloat16, torch.float16) and w.dtype in (x.dtype, torch.int8):
        _rows_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            x, w, w if scale is None else scale, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
            w.element_size(), HAS_SCALE=scale is not None, INT8=w.dtype == torch.int8)
    else:
        # cuBLAS: many rows share each weight read anyway; fp32 rows would round to tf32 in tl.dot.
        torch.matmul(x, w.to(x.dtype).T, out=out)
        if scale is not None:
            out *= scale.to(x.dtype)
    return out


# The deterministic mode's one tile of rows and of K (and warps, stages) for every row count: the same compiled
# program computes a row whatever M is. (An H100 found widened 1-byte weights' rows differing between 16- and 128-row
# tiles, where bf16 ones did not: bench/batch_invariance_probe.py, bench/RESULTS.md.) Only the output columns a
# program takes follow M: few rows want many programs, many rows wide tiles.
INVARIANT_TILES = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=3)


def invariant_block_n(m: int) -> int:
    """The output columns a program of the deterministic mode's product takes at `m` rows (a speed choice only)."""
    return 16 if m <= 16 else 64 if m <= 256 else 128


def invariant_tiles(m: int, n: int, w: torch.Tensor) -> dict:
    """The deterministic mode's tiles for `m` rows of a product with `n` outputs: INVARIANT_TILES, except that a
    bf16/fp16 weight's few rows (decode) take 16-row tiles shaped by N. A 2-byte weight's row has the same bits at
    every tile shape tried (BLOCK_M 16-128, BLOCK_N 16-256, BLOCK_K 32-256, 3-6 stages: the sums over K run in
    MMA steps of 16 in order into one fp32 accumulator; bench/batch_invariance_probe.py's linear_tiles and
    one_row_tiles on an H100), so the tile is a speed choice there: at one row the 64-row tile cost 1.3-2.3x the
    best 16-row one (one_row_tiles, bench/RESULTS.md)."""
    if m > 16 or w.element_size() != 2:
        return dict(INVARIANT_TILES, BLOCK_N=invariant_block_n(m))
    if n <= 2048:  # (few programs: the longest K steps, the deepest pipeline)
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=6)
    return dict(BLOCK_M=16, BLOCK_N=32 if n <= 4096 else 64, BLOCK_K=128, num_warps=4, num_stages=4)


def tiled_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """x [M, K] @ (w[N, K] * scale[N, None]).T -> [M, N] in x's dtype (bf16/fp16) on tensor cores, a row's bits
    the same whatever M (the deterministic mode's product: nanoinfer.backends.cuda.invariant): `_rows_kernel` at
    `invariant_tiles`. w: bf16/fp16 (x's), int8 or fp8 with a per-row `scale`. `residual` [M, N]: added to the
    product as `residual + product` would; `silu`: w is [gate | up] and the output [M, N / 2] is
    row_kernels.silu_mul's of the product (the same bits as those kernels after it, one kernel fewer each)."""
    n, k = w.shape
    m = x.shape[0]
    n = n // 2 if silu else n
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert residual is None or residual.shape == out.shape and residual.stride() == out.stride()
    tiles = invariant_tiles(m, n, w)
    _rows_kernel.fn[(triton.cdiv(n, tiles["BLOCK_N"]), triton.cdiv(m, tiles["BLOCK_M"]))](
        x, w, w if scale is None else scale, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        w.element_size(), HAS_SCALE=scale is not None, INT8=w.dtype == torch.int8, **tiles,
        res_ptr=out if residual is None else residual, RESIDUAL=residual is not None, SILU=silu)
    return out


def fused_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
               silu: bool, residual: torch.Tensor | None, push: Push | None = None,
               rope: RopeWrite | None = None) -> torch.Tensor | None:
    """`gemv` of one row with its neighbours folded in, one kernel where they took one each:
    `norm` (an RMSNorm weight): rms_norm(x, norm, eps) @ w.T; `silu`: w is [gate | up] and the
    output [1, N / 2] is silu(gate) * up of the product; `residual` [1, N] is added to the product;
    `rope`, w is QKV's: each program takes whole RoPE pairs (`program_rows`) and rotates q and k
    in its epilogue, q [1, heads, head_dim] is returned and k and v go into the pool (for heads
    without q/k norms and a pool in the model's dtype: nanoinfer.backends.cuda.rope_write's kernel is the
    reference). The same roundings as those ops unfused but the norm's: its output stays fp32 into the sums
    (nanoinfer.model.decoder's unfused parts are the reference: tests/test_gpu.py).
    `push`: the product goes to the tensor-parallel ranks' slots instead (nanoinfer.backends.cuda.peer_sum),
    and None is returned."""
    n, k = w.shape
    assert x.shape[0] == 1 and x.is_contiguous() and x.shape[1] == k
    assert not silu or (n % 2 == 0 and residual is None and push is None)
    assert rope is None or not (silu or residual is not None or push is not None)
    shape = (1, rope.num_heads, rope.head_dim) if rope is not None else (1, n // 2 if silu else n)
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if push is None else x
    args = (x, w, w if scale is None else scale, out, n, k, w.stride(0), x.stride(0), out.stride(0), w.element_size(),
            x if norm is None else norm, x if residual is None else residual, eps,
            x if push is None else push.table)
    flags = dict(HAS_SCALE=scale is not None, INT8=w.dtype == torch.int8, ROWS=1, NORM=norm is not None, SILU=silu,
                 RESIDUAL=residual is not None, LINE=line_elements(w), **pdl.launch(x.device),
                 **({} if rope is None else rope.args(x, n)))
    if push is None:
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags, PUSH=0)
        return out
    # A push writes into the ranks' slots each time it runs, so it never runs in a tuning: it
    # takes the config that the same product tuned without pushing (a first call here tunes it).
    key = (n, k, w.dtype, silu, norm is not None)
    if key not in push.configs:  # (the arguments of the product unpushed: the same tuning, often done already)
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *args[:3], torch.empty((1, n), dtype=x.dtype, device=x.device), *args[4:-1], x, **flags, PUSH=0)
        push.configs[key] = _gemv_kernel.best_config
    config = push.configs[key]
    _gemv_kernel.fn[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
        *args, **flags, PUSH=push.ranks, **config.all_kwargs())
    return None
