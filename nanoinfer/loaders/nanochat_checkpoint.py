"""nanochat checkpoints, as its checkpoint_manager.py writes them: a directory (e.g.
`chatsft_checkpoints/d20/`) of `model_<step:06d>.pt` (a plain state dict, loaded with
`weights_only=True`) and `meta_<step:06d>.json` (`model_config`: sequence_len, vocab_size,
n_layer, n_head, n_kv_head, n_embd, window_pattern), the tokenizer in `tokenizer/` of
nanochat's base directory (nanoinfer/text/nanochat_tokenizer.py).

The architecture is nanochat's current gpt.py (nanoinfer/model/nanochat.py): the checkpoints it
loads have the smear gate (March 2026 on); older ones, which its own loader also refuses,
get a named error. The model serves contexts up to its `sequence_len` (its long window).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from nanoinfer.model.config import ModelConfig, checkpoint_config
from nanoinfer.model.config_checks import MAX_DIMENSIONS, dimension, heads_share_kv_heads, shown
from nanoinfer.errors import CheckpointError
from nanoinfer.json_files import read_json_object
from nanoinfer.model.nanochat import (ROPE_THETA, SMEAR_CHANNELS, VE_GATE_CHANNELS, NanochatLayerParams, NanochatParams,
                                extra_layers)

# model_config's keys -> ModelConfig's fields (whose MAX_DIMENSIONS bound them)
CONFIG_KEYS = {"sequence_len": "max_position_embeddings", "vocab_size": "vocab_size", "n_layer": "num_layers",
               "n_head": "num_heads", "n_kv_head": "num_kv_heads", "n_embd": "hidden_size"}


def checkpoint_files(path: Path) -> tuple[Path, Path] | None:
    """(model_*.pt, meta_*.json) of the latest step in directory `path`, or of the model file
    `path`; None when `path` is not a nanochat checkpoint."""
    if path.is_file():
        match = re.fullmatch(r"model_(\d+)\.pt", path.name)
        return (path, path.with_name(f"meta_{match.group(1)}.json")) if match else None
    steps = sorted(int(m.group(1)) for f in path.glob("model_*.pt") if (m := re.fullmatch(r"model_(\d+)\.pt", f.name)))
    if not steps:
        return None
    step = f"{steps[-1]:06d}"
    return path / f"model_{step}.pt", path / f"meta_{step}.json"


def tokenizer_file(model_file: Path) -> Path | None:
    """nanochat's tokenizer.pkl for a checkpoint: beside it, or in `tokenizer/` of the
    directories above it (its base directory holds `tokenizer/` and `*_checkpoints/<tag>/`),
    or of $NANOCHAT_BASE_DIR."""
    places = [model_file.parent, *model_file.parent.parents][:4]
    if os.environ.get("NANOCHAT_BASE_DIR"):
        places.append(Path(os.environ["NANOCHAT_BASE_DIR"]))
    for place in places:
        for candidate in (place / "tokenizer.pkl", place / "tokenizer" / "tokenizer.pkl"):
            if candidate.is_file():
                return candidate
    return None


def nanochat_config(meta_file: Path) -> ModelConfig:
    if not meta_file.is_file():
        raise CheckpointError(meta_file, "missing: a nanochat checkpoint has meta_<step>.json beside its "
                                         "model_<step>.pt")
    model = read_json_object(meta_file, "nanochat's meta JSON").get("model_config")
    missing = list(CONFIG_KEYS) if not isinstance(model, dict) else [k for k in CONFIG_KEYS if k not in model]
    if missing:
        raise CheckpointError(meta_file, f"expected nanochat's meta JSON with model_config holding {list(CONFIG_KEYS)}: "
                                         f"it lacks {missing}")
    # (each checked, and bounded, before the per-layer window list below is sized by n_layer)
    values = {k: dimension(k, model[k], meta_file, MAX_DIMENSIONS.get(field)) for k, field in CONFIG_KEYS.items()}
    seq, layers, heads, kv_heads, hidden = (values[k] for k in ("sequence_len", "n_layer", "n_head", "n_kv_head",
                                                                 "n_embd"))
    pattern = model.get("window_pattern", "L")  # (older checkpoints: every layer long)
    if not isinstance(pattern, str) or not pattern or set(pattern.upper()) - {"S", "L"}:
        raise CheckpointError(meta_file, f"window_pattern {shown(pattern)}: expected letters S and L")
    pattern = pattern.upper()
    if hidden % heads:
        raise CheckpointError(meta_file, f"n_embd {hidden} is not a multiple of n_head {heads}")
    heads_share_kv_heads(meta_file, "n_head", heads, "n_kv_head", kv_heads)
    short = -(-seq // 4 // 128) * 128  # (gpt.py: a quarter of the context, in whole 128s)
    windowed = tuple(pattern[i % len(pattern)] == "S" and i != layers - 1 for i in range(layers))
    head_dim = hidden // heads
    return checkpoint_config(
        meta_file,
        architecture="nanochat", vocab_size=values["vocab_size"], hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=torch.finfo(torch.float32).eps,  # (F.rms_norm's eps=None)
        rope_theta=ROPE_THETA, max_position_embeddings=seq, tie_word_embeddings=False,
        # A window of (left, 0) keys in flash-attention terms is left + 1 keys with ours.
        sliding_window=short + 1 if any(windowed) else None,
        windowed_layers=windowed if any(windowed) else None,
        kv_extra_layers=extra_layers(hidden, kv_heads * head_dim))


def load_nanochat_params(model_file: Path, cfg: ModelConfig, dtype: torch.dtype, device) -> NanochatParams:
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(model_file, f"cannot be read as a torch state dict (weights only): {exc}") from exc
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}  # (a compiled model's names)
    if "smear_gate.weight" not in state:
        raise CheckpointError(model_file, "has no smear_gate.weight: a nanochat checkpoint from before March 2026, "
                                          "whose architecture nanochat's current gpt.py (the one supported) no "
                                          "longer loads either")
    hidden, layers, kv = cfg.hidden_size, cfg.num_layers, cfg.kv_size
    padded = -(-cfg.vocab_size // 64) * 64

    def load(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = state.get(name)
        if tensor is None:
            raise CheckpointError(model_file, f"tensor {name!r} is missing")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(model_file, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(device=device, dtype=dtype)

    ones = torch.ones(hidden, dtype=dtype, device=device)  # (parameter-free norms)
    resid, x0 = load("resid_lambdas", (layers,)), load("x0_lambdas", (layers,))
    out = []
    for i in range(layers):
        p = f"transformer.h.{i}."
        has_ve = i % 2 == (layers - 1) % 2  # (gpt.py's has_ve: alternate layers, the last included)
        out.append(NanochatLayerParams(
            attn_norm=ones, mlp_norm=ones, qkv_bias=None, q_norm=None, k_norm=None,
            qkv_proj=torch.cat([load(p + "attn.c_q.weight", (cfg.q_size, hidden)),
                                load(p + "attn.c_k.weight", (kv, hidden)), load(p + "attn.c_v.weight", (kv, hidden))]),
            o_proj=load(p + "attn.c_proj.weight", (hidden, cfg.q_size)),
            gate_up_proj=load(p + "mlp.c_fc.weight", (cfg.intermediate_size, hidden)),
            down_proj=load(p + "mlp.c_proj.weight", (hidden, cfg.intermediate_size)),
            resid_lambda=resid[i:i + 1], x0_lambda=x0[i:i + 1],
            value_embed=load(f"value_embeds.{i}.weight", (padded, kv)) if has_ve else None,
            ve_gate=load(p + "attn.ve_gate.weight", (cfg.num_kv_heads, VE_GATE_CHANNELS)) if has_ve else None))
    return NanochatParams(
        embed=load("transformer.wte.weight", (padded, hidden)), layers=tuple(out), final_norm=ones,
        lm_head=load("lm_head.weight", (padded, hidden)),
        # nanochat rotates by -θ (gpt.py's apply_rotary_emb): our RoPE with negated frequencies.
        rope_inv_freq=-1.0 / ROPE_THETA ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim),
        smear_gate=load("smear_gate.weight", (1, SMEAR_CHANNELS)), smear_lambda=load("smear_lambda", (1,)),
        backout_lambda=load("backout_lambda", (1,)))

