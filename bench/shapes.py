"""Real model shapes with random weights, made directly on the device (speed does not depend
on the values). Shared by the GPU benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch

from nanoinfer.model.config import ModelConfig, RopeScaling
from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.dummy import dummy_params
from nanoinfer.loaders.hf import config_from_hf
from nanoinfer.quant.quantized import nbytes

SHAPES = {
    "qwen3-0.6b": ModelConfig("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e-6, 1e6, 40960, True, qk_norm=True),
    "llama-3.2-1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 5e5, 131072, True,
                                RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 5e5, 131072, False,
                                RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
}

# The other families' shapes as their config.json says them (issue 63), read by the HF loader's own parser.
FAMILIES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral-8x7b": ("MixtralConfig", dict(  # (93 GB in bf16: an H200)
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=32768,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "gemma-3-12b": ("Gemma3TextConfig", dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, rope_theta=1e6,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "phi-4": ("Phi3Config", dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=100352, hidden_size=5120,
        intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
        rope_theta=250000.0, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False)),
}
SHAPES |= {name: config_from_hf(fields, name) for name, (_, fields) in FAMILIES.items()}

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
} | {name: (cls, {k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
     for name, (cls, fields) in FAMILIES.items()}


def random_model(name: str, device="cuda", dtype=torch.bfloat16, quantization: str = "none") -> LoadedModel:
    """Random weights in the shape; with `quantization` (int8, fp8, int4), each layer's quantized as it is made (a
    Mixtral-8x7B in fp8 fits an 80 GB GPU: its bf16 weights would not)."""
    from nanoinfer.loaders.quantize import quantize_head, quantize_layer

    if quantization == "none":
        return LoadedModel(SHAPES[name], dummy_params(SHAPES[name], dtype, device), None, Path(name))
    params = dummy_params(SHAPES[name], dtype, device,
                          layer_form=lambda lp: quantize_layer(lp, quantization, torch.device(device), dtype))
    return LoadedModel(SHAPES[name], quantize_head(params, quantization), None, Path(name), quantization=quantization)


def weight_bytes(model: LoadedModel) -> int:
    """Bytes read per decode step at batch 1: every weight once (the embedding row aside), and of a sparse layer's
    experts only the k a token is routed to."""
    p, cfg = model.params, model.config
    total = nbytes(p.final_norm) + nbytes(p.lm_head)
    for layer in p.layers:
        total += sum(nbytes(w) for name, w in vars(layer).items() if name != "moe")
        if layer.moe is not None:
            experts = nbytes(layer.moe.gate_up) + nbytes(layer.moe.down)
            total += nbytes(layer.moe.router) + experts * cfg.experts_per_token // cfg.num_experts
    return total
