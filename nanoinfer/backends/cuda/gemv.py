"""Linear layers of 1-16 rows on CUDA: Triton kernels that stream the weight at full bandwidth.

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

4-bit weights (nanoinfer.quant.quantized's Int4CudaWeight: AWQ, GPTQ, GGUF's 4-bit groups,
`quantization="int4"`) have kernels of their own, `int4_mm`: one row reads each packed word
once, widens its eight nibbles in registers (to fp32 on CUDA cores, or, for the wide matrices,
to 16-bit floats multiplied on tensor cores) and sums them before their group's scale (the
min times the sum of their inputs), so a batch-1 step reads half a byte per weight; more rows
dequantize each weight tile to the activations' type in registers and multiply it on tensor
cores, at every row count (a prefill too: the weight is never written out dequantized).

One row can push its outputs into the tensor-parallel ranks' peer buffers instead of
writing them (`fused_gemv`'s `push`: nanoinfer.backends.cuda.peer_sum), so the sum over ranks needs no
collective kernel.

On Hopper and later the one-row kernel launches early (nanoinfer.backends.cuda.pdl): its programs fetch
their first weight tile into L2 while the kernel ahead finishes, then wait for it.

`linear(x, w, b)` is what the model calls on CUDA: these kernels up to 16 rows, otherwise
F.linear for a dense weight, and for a quantized one `quantized.linear` (fp8: activations
per token in e4m3 and `torch._scaled_mm`). They are plain functions, not torch custom ops:
nothing compiles around them (calling a custom op imports Dynamo, seconds of a start), and
CUDA graphs capture their launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.testing

from nanoinfer.backends.cuda import pdl
from nanoinfer.quant import quantized
from nanoinfer.quant.quantized import Fp8Weight, Int4CudaWeight, Int8Weight
from nanoinfer.backends.cuda.peer_sum import Push
from nanoinfer.backends.cuda.row_kernels import quantize_rows_fp8
from nanoinfer.backends.cuda.tuned_configs import ShippedChoice


def _line(w: torch.Tensor) -> int:
    """How many of `w`'s elements fill a 128-byte cache line."""
    return 128 // w.element_size()


def _quick_bench(kernel_call, quantiles):
    # A GEMV takes microseconds: 20 ms of repeats rank the configs as well as Triton's default
    # 100 ms, and a start autotunes each projection shape of the model in a quarter of the time.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def _program_rows(N, BLOCK_N: tl.constexpr, SILU: tl.constexpr, HEAD_DIM: tl.constexpr = 0):
    """A one-row GEMV program's rows of w and their mask: BLOCK_N consecutive ones, or with SILU
    (w is [gate | up], N = 2 x units) BLOCK_N / 2 units' gate and up rows, interleaved: row j
    of the tile is unit j // 2's gate row if j is even, its up row if odd. With HEAD_DIM (RoPE's
    pairs, w is QKV's heads of HEAD_DIM rows), unit u is the u % (HEAD_DIM / 2)-th row of its
    head's first half and the same row of its second half, interleaved alike."""
    if SILU or HEAD_DIM > 0:
        rows = tl.arange(0, BLOCK_N)
        units = tl.program_id(0) * (BLOCK_N // 2) + rows // 2
        if HEAD_DIM > 0:
            offs_n = (units // (HEAD_DIM // 2)) * HEAD_DIM + units % (HEAD_DIM // 2) + (rows % 2) * (HEAD_DIM // 2)
        else:
            offs_n = units + (rows % 2) * (N // 2)
        n_mask = units < N // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    return offs_n, n_mask


@triton.jit
def _epilogue(out, offs_n, n_mask, N, res_ptr, dtype: tl.constexpr, BLOCK_N: tl.constexpr, SILU: tl.constexpr,
              RESIDUAL: tl.constexpr):
    """A one-row GEMV's fp32 sums `out` (rows `_program_rows`) -> (outputs, their offsets, mask):
    SILU, silu(gate) * up of each unit, rounded to `dtype` as the GEMV's output, F.silu and the
    product round them (the down projection then reads its input as it is); RESIDUAL, `res` added,
    the sum rounded first as `x + linear(...)` rounds it."""
    if SILU:
        gate, up = tl.split(tl.reshape(out.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
        out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        offs_n = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = offs_n < N // 2
    if RESIDUAL:
        out = out.to(dtype).to(tl.float32) + tl.load(res_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return out, offs_n, n_mask


@triton.jit
def _rope_write_epilogue(out, N, q_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, stride_kv, BLOCK_N: tl.constexpr,
                         NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """QKV's one-token outputs `out` (rows `_program_rows` with HEAD_DIM, rounded to the model's
    dtype) -> RoPE on the q and k pairs, q stored at `q_ptr`, k and v into the paged pool at the
    token's slot: nanoinfer.backends.cuda.rope_write's kernel for a head without q/k norms, its reference."""
    x1, x2 = tl.split(tl.reshape(out.to(tl.float32), [BLOCK_N // 2, 2]))
    units = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = units < N // 2
    head = units // (HEAD_DIM // 2)
    col = units % (HEAD_DIM // 2)
    is_q = head < NUM_HEADS
    is_v = head >= NUM_HEADS + KV_HEADS
    cos = tl.load(cos_ptr + col, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + col, mask=mask, other=0.0).to(tl.float32)
    r1 = tl.where(is_v, x1, x1 * cos - x2 * sin)  # "rotate half" RoPE (nanoinfer.model.layers.apply_rope)
    r2 = tl.where(is_v, x2, x2 * cos + x1 * sin)
    dst = q_ptr + head * HEAD_DIM + col
    tl.store(dst, r1.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    tl.store(dst + HEAD_DIM // 2, r2.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    slot = tl.load(slot_ptr).to(tl.int64)
    kv_head = tl.where(is_v, head - NUM_HEADS - KV_HEADS, head - NUM_HEADS)
    dst = kv_ptr + slot * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + tl.where(is_v, stride_kv, 0) + col
    kv_mask = mask & (head >= NUM_HEADS) & (slot >= 0)  # (padding rows, slot -1, store nothing)
    tl.store(dst, r1.to(kv_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + HEAD_DIM // 2, r2.to(kv_ptr.dtype.element_ty), mask=kv_mask)


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
    key=["N", "K", "W_BYTES", "ROWS", "NORM", "SILU"], do_bench=_quick_bench, cache_results=True,
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
    # LINE: the weight's elements in a 128-byte line (`_line`), the step of the L2 prefetch.
    # ROWS: 1, or 2 (each weight widened once, multiplied with both rows).
    # One row may fold its neighbours in (fused_gemv): NORM, x is RMSNorm'd on the way in: the
    # norm's gain multiplies x in the loop, which also sums x's squares, and 1 / rms scales the
    # sums at the end (a first pass for the rms would hold every weight load back by the
    # latency of reading x); SILU and RESIDUAL, `_epilogue`'s (where the down projection's
    # programs would each recompute SiLU over all of its input).
    offs_n, n_mask = _program_rows(N, BLOCK_N, SILU, HEAD_DIM)
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
        _rope_write_epilogue(out.to(dtype), N, out_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, stride_kv, BLOCK_N,
                             NUM_HEADS, KV_HEADS, HEAD_DIM)
        return
    out, offs_n, n_mask = _epilogue(out, offs_n, n_mask, N, res_ptr, dtype, BLOCK_N, SILU, RESIDUAL)
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
    key=["N", "K", "W_BYTES"], do_bench=_quick_bench, cache_results=True,
    prune_configs_by={"early_config_prune": ShippedChoice("_rows_kernel")},
)
@triton.jit
def _rows_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, W_BYTES,
                 HAS_SCALE: tl.constexpr, INT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Rows of x padded to 16, one tensor-core product per weight tile: the weight is read once
    # for all rows (cuBLAS picks split-K tilings here that ran 10-40% slower than one row).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, 16)
    m_mask = offs_m < M
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if INT8:  # (exact: an int8 is a bf16 or fp16; the widening trick of _gemv_kernel)
            w = ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


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
            RESIDUAL=False, PUSH=0, LINE=_line(w), **pdl.launch(x.device))
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


class RopeWrite(NamedTuple):
    """What QKV's GEMV needs to rotate q and k and store k and v itself (`fused_gemv`, `int4_gemv`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    kv_layer: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    kv_heads: int
    head_dim: int

    def args(self, x: torch.Tensor, n: int) -> dict:
        """The GEMV kernels' keyword arguments for it, checked against the product's x and N."""
        assert n == (self.num_heads + 2 * self.kv_heads) * self.head_dim and self.head_dim % 2 == 0  # (RoPE pairs)
        assert self.kv_layer.is_contiguous()
        assert self.kv_layer.dtype == x.dtype and self.cos.stride(-1) == 1 and self.sin.stride(-1) == 1
        return dict(kv_ptr=self.kv_layer, slot_ptr=self.slot_mapping, cos_ptr=self.cos, sin_ptr=self.sin,
                    stride_kv=self.kv_layer.stride(0), NUM_HEADS=self.num_heads, KV_HEADS=self.kv_heads,
                    HEAD_DIM=self.head_dim)


def fused_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
               silu: bool, residual: torch.Tensor | None, push: Push | None = None,
               rope: RopeWrite | None = None) -> torch.Tensor | None:
    """`gemv` of one row with its neighbours folded in, one kernel where they took one each:
    `norm` (an RMSNorm weight): rms_norm(x, norm, eps) @ w.T; `silu`: w is [gate | up] and the
    output [1, N / 2] is silu(gate) * up of the product; `residual` [1, N] is added to the product;
    `rope`, w is QKV's: each program takes whole RoPE pairs (`_program_rows`) and rotates q and k
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
                 RESIDUAL=residual is not None, LINE=_line(w), **pdl.launch(x.device),
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


# One row's 4-bit kernel has two bodies, and the tuning picks between them per shape. On an H100
# the shipped table (tools/sweep_int4_gemv.py: each config timed in CUDA graphs over cold weights)
# takes the tensor cores' for the gate/up projections (8B 28.9 against 33.9 µs, 1B 11.7 against
# 12.0) and the CUDA cores' elsewhere; Triton's 20 ms tuning, alone, had picked the tensor cores'
# for 8B's down, 9% slower there (bench/RESULTS.md, twenty-fourth and twenty-fifth sessions).
@triton.autotune(
    configs=[triton.Config({"TC": False, "BLOCK_N": n, "GROUPS": g, "SPLIT": 1}, num_warps=w, num_stages=3)
             # several rows a thread for the wide matrices (the 8B shapes' and 1B gate/up's winners on an
             # H100), few for the narrow long ones (1B down): bench/RESULTS.md, twenty-third session
             for n, g, w in ((32, 4, 4), (32, 8, 8), (64, 4, 8), (64, 4, 4), (16, 4, 4), (16, 8, 8), (32, 4, 2),
                             (8, 4, 4), (8, 8, 8), (16, 4, 8), (16, 4, 2), (4, 8, 4), (8, 16, 8), (32, 2, 4),
                             # 16 warps, more groups a step: more bytes in flight where the rows give few
                             # programs (8B down: 256 of 8 warps were half a wave; 19.6 µs against 25.2 timed
                             # as a step runs them: twenty-fifth session)
                             (8, 16, 16), (8, 32, 16), (16, 16, 16), (4, 16, 8), (4, 32, 16), (16, 8, 16), (32, 8, 16),
                             (64, 8, 16), (32, 16, 16), (4, 16, 4))]
    + [triton.Config({"TC": True, "BLOCK_N": n, "GROUPS": 1, "SPLIT": s}, num_warps=w, num_stages=3)
       for n, s, w in ((32, 2, 2), (16, 4, 4), (16, 4, 2), (32, 4, 4), (16, 8, 8), (32, 8, 8), (16, 8, 4),
                       (32, 8, 16), (64, 4, 8))],
    key=["N", "K", "GROUP", "HALF"], do_bench=_quick_bench, cache_results=True,
    # (AWQ's and GPTQ's fp32 scales take the choice swept for the same shape with fp16 ones: a
    # start without it compiles and times all 33 configs for each projection)
    prune_configs_by={"early_config_prune": ShippedChoice("_int4_gemv_kernel", like=("N", "K", "GROUP"))},
)
@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, N, K, stride_wn, stride_sn, EXP, res_ptr,
                      GROUP: tl.constexpr, HALF: tl.constexpr, TC: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS: tl.constexpr, SPLIT: tl.constexpr, SILU: tl.constexpr = False,
                      RESIDUAL: tl.constexpr = False, kv_ptr=None, slot_ptr=None, cos_ptr=None, sin_ptr=None,
                      stride_kv=0, NUM_HEADS: tl.constexpr = 0, KV_HEADS: tl.constexpr = 0,
                      HEAD_DIM: tl.constexpr = 0):
    # One row, BLOCK_N outputs a program, both bodies computing per (row, group)
    # s sum((OFFSET + q) x) + (m - OFFSET s) sum(x): each nibble becomes OFFSET + q by merging
    # its bits into OFFSET's, and the OFFSETs come off once per group. (HALF only keys the tuning;
    # SILU and RESIDUAL, the epilogues `_epilogue` shares with the 16- and 8-bit kernel, do not:
    # a projection takes the config of its plain product; nor does HEAD_DIM, QKV's RoPE and KV write.)
    offs_n, n_mask = _program_rows(N, BLOCK_N, SILU, HEAD_DIM)
    if TC:
        out = _int4_gemv_tensor_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn,
                                      GROUP, BLOCK_N, SPLIT)
    else:
        out = _int4_gemv_cuda_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn, EXP,
                                    GROUP, BLOCK_N, GROUPS)
    dtype = out_ptr.dtype.element_ty
    if HEAD_DIM > 0:
        _rope_write_epilogue(out.to(dtype), N, out_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, stride_kv, BLOCK_N,
                             NUM_HEADS, KV_HEADS, HEAD_DIM)
        return
    out, offs_n, n_mask = _epilogue(out, offs_n, n_mask, N, res_ptr, dtype, BLOCK_N, SILU, RESIDUAL)
    tl.store(out_ptr + offs_n, out.to(dtype), mask=n_mask)


@triton.jit
def _int4_gemv_cuda_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn, EXP,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    # GROUPS whole groups a step, a tile [GROUPS, BLOCK_N, WORDS]. The words are taken a nibble
    # plane at a time (Int4CudaWeight's order: plane k of a group's words is its inputs
    # k WORDS..(k + 1) WORDS, one contiguous load of x), so no tile changes shape; each word sums
    # its products before the group's scale and min meet them.
    # Each nibble becomes the fp32 128 + q in two instructions: moved to bits 16-19 (one shift;
    # none for plane 4) and merged with 128's bits (one LOP3). 128 + q in fp32 keeps 17 bits for
    # q x past the 128 x. The loop is bound by instructions, not bytes (38 a word, bench/sass_count.py),
    # so: EXP is 128.0's bits (0x43000000) passed at run time, because with both masks constants
    # ptxas splits `& mask | bits` into two LOP3s; and the groups lead the tile, so that Triton's
    # layout repeats a thread's words down the rows (its fastest-varying dimensions after the
    # words are the tile's first) and each x load, widening and sum serves several rows.
    WORDS: tl.constexpr = GROUP // 8
    offs_j = tl.arange(0, WORDS)
    acc = tl.zeros([GROUPS, BLOCK_N, WORDS], tl.float32)
    for g0 in range(0, K // GROUP, GROUPS):
        gs = g0 + tl.arange(0, GROUPS)
        g_mask = gs < K // GROUP
        words = tl.load(w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn + (gs * WORDS)[:, None, None]
                        + offs_j[None, None, :], mask=n_mask[None, :, None] & g_mask[:, None, None], other=0)
        dots = tl.zeros([GROUPS, BLOCK_N, WORDS], tl.float32)
        sums = tl.zeros([GROUPS, WORDS], tl.float32)
        for k in tl.static_range(8):
            x = tl.load(x_ptr + (gs * GROUP + k * WORDS)[:, None] + offs_j[None, :], mask=g_mask[:, None],
                        other=0.0).to(tl.float32)
            if k < 4:
                moved = words << (16 - 4 * k)
            else:
                moved = words >> (4 * k - 16)
            dots += ((moved & 0x000F0000) | EXP).to(tl.float32, bitcast=True) * x[:, None, :]
            sums += x
        where = offs_n[None, :] * stride_sn + gs[:, None]
        sg_mask = n_mask[None, :] & g_mask[:, None]
        scale = tl.load(scale_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        acc += scale[:, :, None] * dots + (low - 128.0 * scale)[:, :, None] * sums[:, None, :]
    return tl.sum(tl.sum(acc, 2), 0)


def _nibbles_asm(bits: int) -> str:
    """Inline PTX: two packed words (a, b) in, eight registers of two 16-bit floats out, register k
    (OFFSET + nibble k of a, OFFSET + nibble k of b), each one LOP3 merging the nibbles into
    OFFSET's bits (`bits`, twice: bf16 128.0 is 0x4300, fp16 1024.0 0x6400; in both a nibble lands
    on the mantissa's last four bits, worth 1 apiece). PRMT pairs a's and b's low halves (nibbles
    0-3) and high halves (4-7); a shift by 4, 8 or 12 brings the next nibble of both down: 16
    instructions for 16 weights."""
    merge = f"0x000F000F, {bits:#010x}, 0xea"  # (v & mask) | bits
    lines = ["prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for k in range(8):
        half = "lo" if k < 4 else "hi"
        if k % 4:
            lines.append(f"shr.u32 t, {half}, {4 * (k % 4)};")
        lines.append(f"lop3.b32 ${k}, {'t' if k % 4 else half}, {merge};")
    return "{\n.reg .b32 lo, hi, t;\n" + "\n".join(lines) + "\n}"


_NIBBLES_BF16 = tl.constexpr(_nibbles_asm(0x43004300))
_NIBBLES_FP16 = tl.constexpr(_nibbles_asm(0x64006400))


@triton.jit
def _offset_nibbles(words, dtype: tl.constexpr):
    """[S, R, W] int32 words -> [S, R, 8 W] `dtype` (bf16 or fp16) OFFSET + q in input order: column
    k W + j is word j's nibble k (Int4CudaWeight's order)."""
    if dtype == tl.bfloat16:
        planes = tl.inline_asm_elementwise(_NIBBLES_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                           dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        planes = tl.inline_asm_elementwise(_NIBBLES_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                           dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    p0, p1, p2, p3, p4, p5, p6, p7 = planes
    # Each join adds a last dimension indexed by its operand: t[s, r, j, h, m, l] is plane 4h + 2m + l.
    t = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    # Plane-major: the tensor cores' operand holds these registers as they are (no data moves).
    return tl.reshape(tl.permute(t, (0, 1, 3, 4, 5, 2)), (words.shape[0], words.shape[1], 8 * words.shape[2]))


@triton.jit
def _int4_gemv_tensor_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    # The weights are the MMA's first operand straight from registers: each chunk of a group's
    # words (at most 16: 128 inputs) becomes OFFSET + q in x's type (`_offset_nibbles`, ~16
    # instructions a word where widening to fp32 took 38), and x, in those columns' input order,
    # the second operand's 8 columns (all equal: column 0 is kept, and the compiler drops the
    # others' arithmetic). The MMA's products are exact ((OFFSET + q) and x each fit x's
    # mantissa) and sum in fp32; the group's scale multiplies a chunk's sum. SPLIT adjacent
    # chunks a step in one batched MMA, summed at the end: more loads in flight a program.
    # A chunk's inputs share its group's min, so the mins' term comes in the same loop: the
    # chunk's sum of x times (m - OFFSET s) (a second pass over the groups cost 8B's down 25.2
    # µs against 23.0 and gate/up 28.7 against 28.1: bench/RESULTS.md, twenty-sixth session).
    WORDS: tl.constexpr = GROUP // 8
    CHUNK: tl.constexpr = WORDS if WORDS < 16 else 16
    dtype = x_ptr.dtype.element_ty
    OFFSET: tl.constexpr = 128.0 if dtype == tl.bfloat16 else 1024.0
    offs_s = tl.arange(0, SPLIT)
    offs_c = tl.arange(0, CHUNK)
    # a chunk's column k CHUNK + c is input k WORDS + c of its group, past its first word's
    offs_in = (tl.arange(0, 8)[:, None] * WORDS + offs_c[None, :]).reshape(8 * CHUNK)
    chunks = K // (8 * CHUNK)
    acc = tl.zeros([SPLIT, BLOCK_N, 8], tl.float32)
    mins = tl.zeros([SPLIT, BLOCK_N], tl.float32)
    for c0 in range(0, chunks, SPLIT):
        cs = c0 + offs_s
        c_mask = cs < chunks
        gs = cs * CHUNK // WORDS
        words = tl.load(w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn + (cs * CHUNK)[:, None, None]
                        + offs_c[None, None, :], mask=n_mask[None, :, None] & c_mask[:, None, None], other=0)
        x = tl.load(x_ptr + (gs * GROUP + cs * CHUNK - gs * WORDS)[:, None] + offs_in[None, :],
                    mask=c_mask[:, None], other=0.0)
        d = tl.dot(_offset_nibbles(words, dtype), tl.broadcast_to(x[:, :, None], (SPLIT, 8 * CHUNK, 8)))
        where = offs_n[None, :] * stride_sn + gs[:, None]
        sg_mask = n_mask[None, :] & c_mask[:, None]
        scale = tl.load(scale_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        acc += scale[:, :, None] * d
        mins += (low - OFFSET * scale) * tl.sum(x.to(tl.float32), 1)[:, None]
    return tl.sum(tl.sum(tl.where(tl.arange(0, 8)[None, None, :] == 0, acc, 0.0), 2), 0) + tl.sum(mins, 0)


@triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for m, n, k, w, s in ((16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 32, 256, 4, 3), (16, 64, 256, 4, 4),
                                   (32, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 8, 3),
                                   (128, 128, 128, 8, 3), (128, 64, 128, 4, 4), (128, 256, 128, 8, 3))],
    key=["ROWS", "N", "K", "GROUP"], do_bench=_quick_bench, cache_results=True,
    prune_configs_by={"early_config_prune": ShippedChoice("_int4_mm_kernel")},
)
@triton.jit
def _int4_mm_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                    stride_om, ROWS, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # Several rows: each nibble plane of a weight tile dequantized to x's type in registers and
    # multiplied on tensor cores with the inputs it holds (word w's nibble k: input
    # (w // WORDS) GROUP + k WORDS + w % WORDS, Int4CudaWeight's order), eight products a tile
    # (a sum over the inputs in another order). ROWS (M rounded up to a power of 2) keys the
    # tuning: small batches want narrow tiles and many programs, a prefill wide ones.
    WORDS: tl.constexpr = GROUP // 8
    TILE_WORDS: tl.constexpr = BLOCK_K // 8
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_w = k0 // 8 + tl.arange(0, TILE_WORDS)
        w_mask = offs_w < K // 8
        nw_mask = n_mask[:, None] & w_mask[None, :]
        words = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :], mask=nw_mask, other=0)
        where = offs_n[:, None] * stride_sn + (offs_w // WORDS)[None, :]
        scale = tl.load(scale_ptr + where, mask=nw_mask, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + where, mask=nw_mask, other=0.0).to(tl.float32)
        first = (offs_w // WORDS) * GROUP + offs_w % WORDS  # each word's nibble 0 input
        for k in tl.static_range(8):
            q = (((words >> (4 * k)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (first + k * WORDS)[None, :],
                        mask=m_mask[:, None] & w_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans((q * scale + low).to(x.dtype)), acc)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# 128.0's fp32 bits, a run-time argument of the one-row int4 kernel (why: the kernel's comment)
_BITS_OF_128 = 0x43000000


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ the Int4CudaWeight (packed, scale, low: its min).T -> [M, N],
    fp32 accumulation; one row in the GEMV kernel, more in the tensor-core one."""
    n, k = packed.shape[0], packed.shape[1] * 8
    group = k // scale.shape[1]
    m = x.shape[0]
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 1:
        _int4_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *int4_gemv_args(x, packed, scale, low, out), GROUP=group, HALF=scale.dtype == torch.float16)
        return out
    _int4_mm_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))](
        x, packed, scale, low, out, m, n, k, x.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
        triton.next_power_of_2(m), GROUP=group)
    return out


def int4_gemv(x: torch.Tensor, w: Int4CudaWeight, silu: bool = False, residual: torch.Tensor | None = None,
              rope: RopeWrite | None = None) -> torch.Tensor:
    """One row x [1, K] @ w.T with nanoinfer.backends.cuda.fused_layers' epilogues, one kernel where they took
    one each: `silu`, w is [gate | up] and the output [1, N / 2] is silu(gate) * up;
    `residual` [1, N] is added; `rope`, w is QKV's and q [1, heads, head_dim] comes out RoPE'd,
    k and v stored (as `fused_gemv`'s). The same roundings as `int4_mm`, then
    row_kernels' silu_mul, the add, or nanoinfer.backends.cuda.rope_write's kernel. Needs `int4_kernels_take(w)`."""
    n, k = w.shape
    assert x.shape == (1, k) and x.dtype in (torch.bfloat16, torch.float16) and int4_kernels_take(w)
    assert not silu or (n % 2 == 0 and residual is None and rope is None)
    assert residual is None or (residual.shape == (1, n) and residual.dtype == x.dtype and residual.is_contiguous())
    x = (x if w.cols is None else x.index_select(1, w.cols)).contiguous()
    shape = (1, rope.num_heads, rope.head_dim) if rope is not None else (1, n // 2 if silu else n)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        *int4_gemv_args(x, w.packed, w.scale, w.min, out, residual), GROUP=w.group,
        HALF=w.scale.dtype == torch.float16, SILU=silu, RESIDUAL=residual is not None,
        **({} if rope is None else rope.args(x, n)))
    return out


def int4_gemv_args(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, out: torch.Tensor,
                   residual: torch.Tensor | None = None) -> tuple:
    """`_int4_gemv_kernel`'s positional arguments for one row x @ (packed, scale, low).T into
    `out`: what the launches here pass, and so what tools/sweep_int4_gemv.py times and files its
    choices under (the tuner's key holds every tensor argument's dtype)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    return (x, packed, scale, low, out, n, k, packed.stride(0), scale.stride(0), _BITS_OF_128,
            x if residual is None else residual)


def int4_kernels_take(w: Int4CudaWeight) -> bool:
    """Whether `int4_mm` takes `w`: groups of a power of two from 32 up (a word's eight inputs
    share a group); others (GPTQ's one group per row of 14,336, say) run the
    reference, dequantizing."""
    group = w.group
    return group >= 32 and group & (group - 1) == 0


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
