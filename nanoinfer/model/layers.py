"""Pure tensor functions the model is made of: RMSNorm, RoPE (with scaling), SwiGLU and GeGLU, soft-capping."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanoinfer.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. The statistics are taken in fp32 and the result cast back
    before the weight multiplies, in the order transformers uses, so bf16 rounds the same."""
    if x.dtype == torch.float32:  # (the same, without two no-op casts: each costs microseconds on the CPU)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, context: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) with the config's scaling applied. `context`: the longest
    sequence the engine runs, for longrope, whose long factors serve a context past the original one (chosen
    once for every sequence, as llama.cpp chooses by its context size: a sequence's tokens never depend on
    its neighbours or on its own length; None, the original context's short factors)."""
    inv_freq = _scaled_inv_freq(cfg, context)
    if cfg.rotary_dim is None or cfg.rotary_dim == cfg.head_dim:
        return inv_freq
    # (partial rotary: the pairs past the rotated ones turn at frequency 0, cos 1 and sin 0, as if not rotated)
    return torch.cat((inv_freq, inv_freq.new_zeros((cfg.head_dim - cfg.rotary_dim) // 2)))


def _scaled_inv_freq(cfg: ModelConfig, context: int | None) -> torch.Tensor:
    """The rotated pairs' inverse frequencies [rotary_dim // 2] with the config's scaling applied."""
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "longrope":
        long = context is not None and context > scaling.original_max_position_embeddings
        return inv_freq / torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama-3.1's recipe, as transformers implements it).
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def local_rope_inv_freq(cfg: ModelConfig) -> torch.Tensor | None:
    """The windowed layers' inverse frequencies where they have a base of their own (Gemma 3's
    rope_local_base_freq, unscaled); None where they rotate as the others."""
    if cfg.rope_local_theta is None:
        return None
    dim = cfg.head_dim
    return 1.0 / (cfg.rope_local_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin: [tokens, head_dim // 2] for the given absolute positions, made in fp32 and
    cast once (long positions lose precision in bf16)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [tokens, heads, head_dim] in the "rotate half" layout (HF's; GGUF llama
    weights are un-permuted into it on load)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, for the fused [tokens, 2 * intermediate] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU, transformers' gelu_pytorch_tanh), for the fused projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_activation(gate_up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The config's gated MLP activation of the fused [tokens, 2 * intermediate] projection."""
    return gelu_tanh_mul(gate_up) if cfg.hidden_act == "gelu_tanh" else swiglu(gate_up)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap: Gemma's soft-capping of attention scores and logits (in x's dtype, as transformers)."""
    return torch.tanh(x / cap) * cap
