"""What the one-row GEMVs of every weight type share (nanoinfer.backends.cuda.gemv's 16- and 8-bit kernel,
nanoinfer.backends.cuda.int4_gemv's 4-bit one): which rows of the weight a program owns, the epilogues that fold a
layer's next ops into the product (SiLU, the residual; RoPE and the KV write, with `RopeWrite`'s arguments), and
the tuner's quick timer."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
import triton.testing


def line_elements(w: torch.Tensor) -> int:
    """How many of `w`'s elements fill a 128-byte cache line."""
    return 128 // w.element_size()


def quick_bench(kernel_call, quantiles):
    # A GEMV takes microseconds: 20 ms of repeats rank the configs as well as Triton's default
    # 100 ms, and a start autotunes each projection shape of the model in a quarter of the time.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def program_rows(N, BLOCK_N: tl.constexpr, SILU: tl.constexpr, HEAD_DIM: tl.constexpr = 0):
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
def epilogue(out, offs_n, n_mask, N, res_ptr, dtype: tl.constexpr, BLOCK_N: tl.constexpr, SILU: tl.constexpr,
              RESIDUAL: tl.constexpr):
    """A one-row GEMV's fp32 sums `out` (rows `program_rows`) -> (outputs, their offsets, mask):
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
def rope_write_epilogue(out, N, q_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, stride_kv, BLOCK_N: tl.constexpr,
                         NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """QKV's one-token outputs `out` (rows `program_rows` with HEAD_DIM, rounded to the model's
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
