"""forward_of(cfg): the forward a model's architecture runs — the shared decoder's
(nanoinfer/model.py: Llama, Mistral, Qwen2, Qwen3) or a dataflow of its own (nanochat)."""

from __future__ import annotations

from typing import Callable

from nanoinfer.config import ModelConfig
from nanoinfer.model import forward


def forward_of(cfg: ModelConfig) -> Callable:
    """`forward(params, kv, batch, cfg, backend, layer_fns, logits_dtype) -> logits` for `cfg`.
    (nanochat's module is imported only for a nanochat model.)"""
    if cfg.architecture == "nanochat":
        from nanoinfer import nanochat

        return nanochat.forward
    return forward
