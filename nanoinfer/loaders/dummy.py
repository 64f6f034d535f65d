"""Random weights for a model's config: `load_format="dummy"`, as vLLM names it.

A checkpoint's config and tokenizer with weights that were never read: what benchmarks and
serving tests need where the weights are not at hand (speed does not depend on their values).
The scale keeps activations and logits of O(1) spread, so nothing overflows in half precision.
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.layers import local_rope_inv_freq, rope_inv_freq
from nanoinfer.model.decoder import LayerParams, Params


def dummy_params(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                 layer_form: Callable[[LayerParams], LayerParams] | None = None) -> Params:
    """`layer_form` (a quantization's: nanoinfer.loaders.quantize.quantize_layer) turns each layer as it is made:
    the float weights of one layer at a time, not of the model."""
    form = layer_form or (lambda lp: lp)
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen) * shape[-1] ** -0.5

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    def experts():
        from nanoinfer.model.moe import MoEParams

        e, inter, hidden = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
        return MoEParams(w(e, hidden), w(e, 2 * inter, hidden), w(e, hidden, inter))

    qkv = cfg.q_size + 2 * cfg.kv_size
    layers = tuple(form(LayerParams(ones(cfg.hidden_size), w(qkv, cfg.hidden_size),
                               w(qkv) * 0.1 if cfg.qkv_bias else None,
                               ones(cfg.head_dim) if cfg.qk_norm else None, ones(cfg.head_dim) if cfg.qk_norm else None,
                               w(cfg.hidden_size, cfg.q_size), ones(cfg.hidden_size),
                               None if sparse else w(2 * cfg.intermediate_size, cfg.hidden_size),
                               None if sparse else w(cfg.hidden_size, cfg.intermediate_size),
                               *((ones(cfg.hidden_size), ones(cfg.hidden_size)) if cfg.sandwich_norms else (None, None)),
                               moe=experts() if sparse else None))
                   for sparse in cfg.layer_sparse)
    local = local_rope_inv_freq(cfg)
    embed = w(cfg.vocab_size, cfg.hidden_size)
    return Params(embed, layers, ones(cfg.hidden_size),
                  embed if cfg.tie_word_embeddings else w(cfg.vocab_size, cfg.hidden_size),
                  rope_inv_freq(cfg).to(device), None if local is None else local.to(device))
