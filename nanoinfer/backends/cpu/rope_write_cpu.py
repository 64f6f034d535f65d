"""RoPE and the KV write for the CPU in a few torch ops per layer (CUDA has a kernel for it).

The reference (`model.attention_inputs` and the backend's `write_kv`) rotates q and k apart,
each in eight ops over half-head slices, then filters and stores k and v in six more. On the
CPU every op costs microseconds whatever its size, which at 30 layers and a 135M model is a
good part of a decode step. Here q and k rotate together as one tensor, with tables made once
per step that cover the whole head (`rope_tables`: x * cos + roll(x) * signed sin), and k and
v go into the pool in one indexed store. Same arithmetic as the reference; tested against it.
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.kv_cache import to_kv
from nanoinfer.model.layers import rms_norm, rope_cos_sin
from nanoinfer.model.decoder import LayerParams, qkv_projection


def qkv_rope_and_write(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear: Callable, cos: torch.Tensor,
                       sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q from x: nanoinfer.model.decoder's `qkv_projection`, then `rope_and_write` (LayerFunctions' seam)."""
    return rope_and_write(qkv_projection(x, lp, cfg, linear), lp.q_norm, lp.k_norm, cos, sin, kv_layer, slot_mapping,
                          cfg)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sign-folded sin [tokens, 1, head_dim] for the rotate-half layout."""
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]


def rope_and_write(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                   cfg: ModelConfig) -> torch.Tensor:
    """q [tokens, heads, head_dim] from qkv [tokens, q_size + 2 * kv_size]; k and v go into
    kv_layer [2, num_blocks, block_size, kv_heads, head_dim] at `slot_mapping` (-1: skipped).
    `cos`, `sin` are `rope_tables`'."""
    tokens, heads, kv_heads, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qk = qkv[:, : cfg.q_size + cfg.kv_size].view(tokens, heads + kv_heads, d)
    if cfg.qk_norm:
        qk = torch.cat((rms_norm(qk[:, :heads], q_norm, cfg.rms_norm_eps),
                        rms_norm(qk[:, heads:], k_norm, cfg.rms_norm_eps)), dim=1)
    # roll by half a head swaps the halves: (x1, x2) -> (x2, x1); with sin = (-sin, sin) this is
    # (x1 cos - x2 sin, x2 cos + x1 sin), the reference's apply_rope.
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
    k, v = qk[:, heads:], qkv[:, cfg.q_size + cfg.kv_size:].view(tokens, kv_heads, d)
    if tokens and int(slot_mapping.min()) < 0:  # (a negative index would wrap around to the pool's end)
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    kv_layer.view(2, -1, kv_heads, d)[:, slot_mapping] = to_kv(torch.stack((k, v)), kv_layer.dtype)
    return qk[:, :heads]
