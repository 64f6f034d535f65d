"""Real model shapes with random weights, made directly on the device (speed does not depend
on the values). Shared by the GPU benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch

from nanoinfer.model.config import ModelConfig, RopeScaling
from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.dummy import dummy_params
from nanoinfer.quant.quantized import nbytes

SHAPES = {
    "qwen3-0.6b": ModelConfig("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e-6, 1e6, 40960, True, qk_norm=True),
    "llama-3.2-1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 5e5, 131072, True,
                                RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 5e5, 131072, False,
                                RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
}

HF_CONFIGS = {  # the same shapes for transformers (the baseline)
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True, rope_theta=1e6)),
    "llama-3.2-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=64, tie_word_embeddings=True, rope_theta=5e5)),
    "llama-3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, tie_word_embeddings=False, rope_theta=5e5)),
}


def random_model(name: str, device="cuda", dtype=torch.bfloat16) -> LoadedModel:
    return LoadedModel(SHAPES[name], dummy_params(SHAPES[name], dtype, device), None, Path(name))


def weight_bytes(model: LoadedModel) -> int:
    """Bytes read per decode step at batch 1: every weight once (the embedding row aside)."""
    p = model.params
    weights = [w for layer in p.layers for w in vars(layer).values()] + [p.final_norm, p.lm_head]
    return sum(nbytes(w) for w in weights)
