"""Tiny random models for tests: our own Params directly, or transformers checkpoints on disk."""

from __future__ import annotations

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.layers import rope_inv_freq
from nanoinfer.model.decoder import LayerParams, Params
from nanoinfer.quant.quantized import GroupedWeight


def tiny_config(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, tie_word_embeddings=False)
    base.update(overrides)
    return ModelConfig(**base)


def grouped(w: torch.Tensor, bits: int) -> GroupedWeight:
    """w rounded to asymmetric groups of 32 (each group's min and max on the grid), as GGUF's
    block formats hold a matrix."""
    g = w.float().unflatten(1, (-1, 32))
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low).clamp(min=1e-6) / (2**bits - 1)
    q = torch.round((g - low[..., None]) / scale[..., None]).to(torch.uint8).flatten(1)
    return GroupedWeight(q, scale, low, bits)


def random_params(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> Params:
    """Weights scaled so that activations and logits have O(1) spread (peaked softmaxes)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    qkv = cfg.q_size + 2 * cfg.kv_size
    layers = tuple(
        LayerParams(
            attn_norm=norm(cfg.hidden_size),
            qkv_proj=w(qkv, cfg.hidden_size),
            qkv_bias=w(qkv, scale=0.1) if cfg.qkv_bias else None,
            q_norm=norm(cfg.head_dim) if cfg.qk_norm else None,
            k_norm=norm(cfg.head_dim) if cfg.qk_norm else None,
            o_proj=w(cfg.hidden_size, cfg.q_size),
            mlp_norm=norm(cfg.hidden_size),
            gate_up_proj=w(2 * cfg.intermediate_size, cfg.hidden_size),
            down_proj=w(cfg.hidden_size, cfg.intermediate_size),
        )
        for _ in range(cfg.num_layers)
    )
    embed = w(cfg.vocab_size, cfg.hidden_size, scale=1.0)
    return Params(embed=embed, layers=layers, final_norm=norm(cfg.hidden_size),
                  lm_head=embed if cfg.tie_word_embeddings else w(cfg.vocab_size, cfg.hidden_size, scale=0.5),
                  rope_inv_freq=rope_inv_freq(cfg))


def prefill_logits(params: Params, cfg: ModelConfig) -> torch.Tensor:
    """Every row's logits of one 15-token prefill (fp32 pool, CPU): what the quantization tests compare."""
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.model.decoder import forward
    from nanoinfer.model.kv_cache import allocate_kv_pool

    tokens = list(range(3, 60, 4))
    batch = build_batch([SeqChunk(tokens, 0, [0], True)], 16)._replace(logits_indices=torch.arange(len(tokens)))
    return forward(params, allocate_kv_pool(cfg, 4, 16, torch.float32, "cpu"), batch, cfg)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """The RMS of got - want over the RMS of want."""
    return float(((got - want).pow(2).mean() / want.pow(2).mean()).sqrt())


def patch_forward(monkeypatch, fn) -> None:
    """Every ModelRunner's eager forward (graph replays aside) becomes `fn(batch, real)`, where
    `real(batch)` runs the forward it replaced: how tests inject faults into a step."""
    from runtime.executor.model_runner import ModelRunner

    real = ModelRunner._forward
    monkeypatch.setattr(ModelRunner, "_forward", lambda self, batch: fn(batch, lambda b: real(self, b)))


def byte_level_tokenizer(path, vocab_size: int = 600):
    """A byte-level BPE tokenizer (every byte a token, merges learned from a little JSON and
    prose, EOS `<|end|>` id 0) written as a HF directory at `path` and loaded: a real
    `tokenizers` vocabulary for machines without the default model (the GPU one)."""
    import json
    from pathlib import Path

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from nanoinfer.text.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name":"Ann","age":31}', '{"a":[1,2,3],"b":true,"c":null}', "The quick brown fox jumps.",
              "red green blue 0123456789"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return Tokenizer.from_hf_dir(path)


def qwen3_shaped(path, num_layers: int = 28):
    """(transformers' model, ours) of the Qwen3-0.6B shape (its first `num_layers` layers) on CUDA, random bf16
    weights (`initializer_range` 0.05: near-ties everywhere) saved by transformers into `path` and loaded by us."""
    import transformers

    from nanoinfer.loaders import LoadedModel
    from nanoinfer.loaders.hf import load_hf_params, read_hf_config

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                      num_hidden_layers=num_layers, num_attention_heads=16, num_key_value_heads=8,
                                      head_dim=128, tie_word_embeddings=True, initializer_range=0.05)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    hf.save_pretrained(path)
    cfg = read_hf_config(path)
    return hf, LoadedModel(cfg, load_hf_params(path, cfg, torch.bfloat16, "cuda", progress=False), None, path)
