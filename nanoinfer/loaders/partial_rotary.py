"""Partial rotary (Phi-4-mini's `partial_rotary_factor`) as the one RoPE every kernel has: q's and k's rows reordered.

transformers rotates the first `rotary_dim` of each head, pairing dimension i with i + rotary_dim / 2, and passes the
rest through. Every RoPE of ours (the reference, the CPU's C layer, CUDA's kernels and GEMV epilogues) pairs i with
i + head_dim / 2 over the whole head. Reordering the dimensions of every q and k head at load (their projection
rows, their norms) puts each rotated pair where ours pairs it, and the passed-through dimensions in pairs whose
frequency is 0 (`model/layers.py`'s `rope_inv_freq`: cos 1, sin 0, so x comes out as it went in). q . k is a sum
over a head's dimensions, the same in any order as long as q's and k's agree; v and the attention's output keep
theirs. So no kernel has a partial-rotary variant, and a model without it runs none of this.

Longrope's attention factor scales cos and sin, so transformers multiplies the rotated part of q . k by its
square and not the rest; ours applies that square to the whole of q . k (`ModelConfig.softmax_scale`), so q's
passed-through dimensions are divided by it here (its projection rows, or its norm's entries where the model
norms q after the projection).
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoinfer.errors import CheckpointError
from nanoinfer.model.config import ModelConfig

# The tensors whose rows (or, for the norms, entries) are q's or k's head dimensions.
_HEAD_ROWS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias")
_HEAD_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def rotate_half_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """order[j]: the dimension of a transformers head that sits at j in ours. Rotated pair (i, i + rotary_dim / 2)
    goes to (i, i + head_dim / 2); the passed-through dimensions fill the pairs after them, half in each half."""
    r2, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat((torch.arange(0, r2), torch.arange(rotary_dim, rotary_dim + rest), torch.arange(r2, rotary_dim),
                      torch.arange(rotary_dim + rest, head_dim)))


def rotate_half_rows(get: Callable, cfg: ModelConfig, path) -> Callable:
    """`get` (a loader's tensor by name) with q's and k's head dimensions in `rotate_half_order`."""
    order = rotate_half_order(cfg.head_dim, cfg.rotary_dim)
    scaling = cfg.rope_scaling
    factor = scaling.attention_factor if scaling is not None and scaling.kind == "longrope" else 1.0
    # Per dimension of ours: 1 where rotated, 1 / factor^2 where passed through (q's, where it is scaled).
    half, r2 = cfg.head_dim // 2, cfg.rotary_dim // 2
    passed = torch.ones(cfg.head_dim, dtype=torch.float64)
    passed[r2:half] = passed[half + r2:] = 1.0 / (factor * factor)
    q_scaled = "self_attn.q_norm.weight" if cfg.qk_norm else "self_attn.q_proj."

    def reordered(name: str):
        tensor = get(name)
        if tensor is None or not name.endswith(_HEAD_ROWS + _HEAD_NORMS):
            return tensor
        if type(tensor) is not torch.Tensor:  # (an fp8 or 4-bit matrix: its scales would need the same order)
            raise CheckpointError(path, f"{name}: partial rotary over a {type(tensor).__name__} is not supported: "
                                        "expected a float16, bfloat16 or float32 checkpoint")
        heads = 1 if name.endswith(_HEAD_NORMS) else tensor.shape[0] // cfg.head_dim
        out = tensor.reshape(heads, cfg.head_dim, -1)[:, order]
        if factor != 1.0 and q_scaled in name:
            out = (out.double() * passed[None, :, None]).to(tensor.dtype)
        return out.reshape(tensor.shape)
    return reordered
