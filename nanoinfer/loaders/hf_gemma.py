"""Gemma 2 and Gemma 3 (text) from HF directories: their config's flags of the shared forward, their norms' +1.

A Gemma is the shared decoder (nanoinfer/model/decoder.py) with flags on: the embedding scaled by
sqrt(hidden), sandwich norms, a GeGLU MLP, attention's scale from `query_pre_attn_scalar`, soft-capped
attention scores (Gemma 2) and logits, alternating windowed and global layers, and (Gemma 3) q/k norms
and a RoPE base of the windowed layers' own. Its RMSNorms multiply by (1 + weight): the one is added
here, at load, so that the norm is everyone's (llama.cpp's converter adds it in the GGUF likewise).
A `Gemma3ForConditionalGeneration` directory loads its language model: `text_config`, and its tensors
under `language_model.model.` (transformers 4's and 5's files) or `model.language_model.` (some 4.5x saves).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from nanoinfer.errors import CheckpointError
from nanoinfer.model.config_checks import dimension, positive_number, shown

# Gemma3TextConfig's defaults: a multimodal checkpoint's text_config often holds only what differs from them.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                            max_position_embeddings=131_072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                            sliding_window=4096, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
# Gemma2Config's soft-capping defaults (Gemma 3 has none by default)
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def text_config(cfg: Mapping[str, Any], path) -> Mapping[str, Any]:
    """The language model's config.json fields: `cfg` itself, or a multimodal Gemma 3's `text_config` over
    Gemma3TextConfig's defaults."""
    if "Gemma3ForConditionalGeneration" not in (cfg.get("architectures") or []):
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise CheckpointError(path, f"text_config is {shown(text)}: a Gemma3ForConditionalGeneration config "
                                    "describes its language model there (a JSON object)")
    # (whether the LM head is the embedding is the whole model's setting, as transformers ties it)
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    merged = {**GEMMA3_TEXT_DEFAULTS, **text, "tie_word_embeddings": tied, "architectures": ["Gemma3ForCausalLM"]}
    if "rope_theta" not in merged and not merged.get("rope_parameters"):
        merged["rope_theta"] = 1_000_000.0  # (the global layers' default base)
    return merged


def gemma_fields(cfg: Mapping[str, Any], arch: str, path) -> dict[str, Any]:
    """ModelConfig's Gemma fields as transformers reads config.json (`arch`: "gemma2" or "gemma3")."""
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(path, "use_bidirectional_attention is not supported (an embedding model's attention): "
                                    "expected a causal Gemma")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(path, f"hidden_activation {shown(act)} is not supported: expected 'gelu_pytorch_tanh'")

    def cap(name: str) -> float | None:
        value = cfg.get(name, GEMMA2_SOFTCAPS.get(name) if arch == "gemma2" else None)
        return None if value is None else positive_number(name, value, path)

    hidden = dimension("hidden_size", cfg.get("hidden_size"), path)
    return dict(hidden_act="gelu_tanh", embed_scale=hidden**0.5, sandwich_norms=True,
                attn_softcap=cap("attn_logit_softcapping"), final_softcap=cap("final_logit_softcapping"),
                query_pre_attn_scalar=positive_number("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", 256),
                                                      path),
                rope_local_theta=_local_theta(cfg, path) if arch == "gemma3" else None)


def _local_theta(cfg: Mapping[str, Any], path) -> float:
    """Gemma 3's windowed layers' RoPE base: transformers 5's rope_parameters["sliding_attention"], or 4's
    rope_local_base_freq; unscaled (its scaling serves the global layers only)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "sliding_attention" in params:
        local = params["sliding_attention"] or {}
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise CheckpointError(path, f"rope_parameters.sliding_attention has rope_type {shown(kind)}: scaling "
                                        "of the windowed layers' RoPE is not supported (expected 'default')")
        return positive_number("rope_parameters.sliding_attention.rope_theta", local.get("rope_theta", 10_000.0), path)
    return positive_number("rope_local_base_freq", cfg.get("rope_local_base_freq", 10_000.0), path)


def gemma_tensors(read: Callable[[str], Any], names: Mapping[str, Any]) -> Callable[[str], Any]:
    """`read` under the shared loader's names (model.*, lm_head.weight): a multimodal directory's language model
    found under its prefix, and each RMSNorm's weight w as 1 + w (in fp32, before the cast to the model's dtype)."""
    prefixes = {"model.": "model.", "lm_head.": "lm_head."}
    if any(n.startswith("language_model.") for n in names):
        prefixes = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
    elif any(n.startswith("model.language_model.") for n in names):
        prefixes = {"model.": "model.language_model.", "lm_head.": "lm_head."}

    def get(name: str):
        ours = next((p for p in prefixes if name.startswith(p)), "")
        tensor = read(prefixes.get(ours, "") + name.removeprefix(ours))
        if isinstance(tensor, torch.Tensor) and name.endswith("norm.weight"):
            return tensor.float() + 1.0
        return tensor

    return get
