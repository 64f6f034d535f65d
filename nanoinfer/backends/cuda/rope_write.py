"""One Triton kernel for everything between the QKV projection and attention, on CUDA.

After `qkv = linear(rms_norm(x), W_qkv)` a layer needs, per token: the q/k head RMSNorm
(Qwen3), RoPE on q and k, and k, v stored into the paged KV pool at the token's slot.
Inductor compiles that into four or five small kernels plus our KV-write kernel; at
batch 1 each is a ~1.2 µs launch doing almost nothing (a profile of the Qwen3-0.6B shape:
7 µs per layer, 200 µs a token). Here one program per (token, head) does all of it.

The reference is `model.attention_inputs` followed by the backend's `write_kv`; this kernel
keeps the intermediates in fp32 (as Inductor does) and rounds once where the reference
rounds the normalized head to the model dtype before the norm weight, so results agree to
bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda import pdl
from nanoinfer.model.config import ModelConfig


@triton.jit
def _rope_write_kernel(qkv_ptr, q_out_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
                       stride_qkv, stride_qo, stride_cos, stride_kv, eps,
                       NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF_PAD: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # (nanoinfer.backends.cuda.pdl)
        pdl.start()
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads, in the projection's column order
    # Each half of the head in a tile of HALF_PAD (a power of two: tl.arange's rule) columns;
    # past HEAD_DIM // 2 they are masked. For a power-of-two head_dim the mask is a constant
    # `True` that folds away: the compiled kernel is the unpadded one.
    half = tl.arange(0, HALF_PAD)
    if HALF_PAD == HEAD_DIM // 2:
        in_half = tl.full([HALF_PAD], 1, tl.int1)
    else:
        in_half = half < HEAD_DIM // 2
    src = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + half, mask=in_half, other=0.0).to(tl.float32)  # padded columns: 0, so the norm is exact
    x2 = tl.load(src + HEAD_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)
    is_q = head < NUM_HEADS
    is_v = head >= NUM_HEADS + KV_HEADS
    if FP8 and is_v:  # saturate into an fp8 pool (e4m3 has no infinity: past 448 is NaN)
        x1 = tl.clamp(x1, -448.0, 448.0)
        x2 = tl.clamp(x2, -448.0, 448.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    kv_head = tl.where(is_v, head - NUM_HEADS - KV_HEADS, head - NUM_HEADS)
    dst = kv_ptr + slot * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + tl.where(is_v, stride_kv, 0)
    if is_v:
        if slot >= 0:  # padding rows (slot -1) store nothing
            tl.store(dst + half, x1.to(kv_ptr.dtype.element_ty), mask=in_half)
            tl.store(dst + HEAD_DIM // 2 + half, x2.to(kv_ptr.dtype.element_ty), mask=in_half)
        return
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM + eps)
        if is_q:
            w_ptr = q_norm_ptr
        else:
            w_ptr = k_norm_ptr
        # Round the normalized head to the model dtype before the weight, as rms_norm does.
        x1 = (x1 * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32) * tl.load(
            w_ptr + half, mask=in_half, other=0.0).to(tl.float32)
        x2 = (x2 * rstd).to(qkv_ptr.dtype.element_ty).to(tl.float32) * tl.load(
            w_ptr + HEAD_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + half, mask=in_half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + half, mask=in_half, other=0.0).to(tl.float32)
    r1 = x1 * cos - x2 * sin  # "rotate half" RoPE (nanoinfer.model.layers.apply_rope)
    r2 = x2 * cos + x1 * sin
    if is_q:
        out = q_out_ptr + token * stride_qo + head * HEAD_DIM
        tl.store(out + half, r1.to(q_out_ptr.dtype.element_ty), mask=in_half)
        tl.store(out + HEAD_DIM // 2 + half, r2.to(q_out_ptr.dtype.element_ty), mask=in_half)
    elif slot >= 0:
        if FP8:
            r1 = tl.clamp(r1, -448.0, 448.0)
            r2 = tl.clamp(r2, -448.0, 448.0)
        tl.store(dst + half, r1.to(kv_ptr.dtype.element_ty), mask=in_half)
        tl.store(dst + HEAD_DIM // 2 + half, r2.to(kv_ptr.dtype.element_ty), mask=in_half)


def rope_and_write(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                   cfg: ModelConfig) -> torch.Tensor:
    """q [tokens, heads, head_dim] from qkv [tokens, q_size + 2 * kv_size]; k and v go into
    kv_layer [2, num_blocks, block_size, kv_heads, head_dim] at `slot_mapping` (-1: skipped)."""
    tokens = qkv.shape[0]
    d = cfg.head_dim
    assert qkv.stride(-1) == 1 and kv_layer.is_contiguous() and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    q = torch.empty((tokens, cfg.num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    norm = q_norm if cfg.qk_norm else qkv  # (any pointer: unread without QK_NORM)
    _rope_write_kernel[(tokens, cfg.num_heads + 2 * cfg.num_kv_heads)](
        qkv, q, kv_layer, slot_mapping, cos, sin, norm, k_norm if cfg.qk_norm else norm,
        qkv.stride(0), q.stride(0), cos.stride(0), kv_layer.stride(0), cfg.rms_norm_eps,
        NUM_HEADS=cfg.num_heads, KV_HEADS=cfg.num_kv_heads, HEAD_DIM=d, HALF_PAD=triton.next_power_of_2(d // 2),
        QK_NORM=cfg.qk_norm, FP8=kv_layer.dtype == torch.float8_e4m3fn, num_warps=1, **pdl.launch(qkv.device))
    return q
