"""ModelConfig: the frozen description of a model's shapes and numerics, from HF or GGUF."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from nanoinfer.errors import CheckpointError

# HF `architectures[0]` -> our family name. All four share one forward, driven by flags.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" or "llama3" (Llama-3.1's wavelength-band
    interpolation); the other fields only matter for llama3."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "nanochat" (nanoinfer/nanochat.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # keys older than this many positions are masked, in windowed layers
    windowed_layers: tuple[bool, ...] | None = None  # per layer (Qwen's layer_types); None = all of them
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's own dtype, for dtype="auto"
    # Pool layers past the model's, for per-token state a family keeps beside its keys and
    # values (nanochat: each token's normed embedding, which the next token's smear reads).
    kv_extra_layers: int = 0

    def __post_init__(self):
        if self.windowed_layers is not None and len(self.windowed_layers) != self.num_layers:
            raise ValueError(f"windowed_layers has {len(self.windowed_layers)} entries for {self.num_layers} layers")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window; None for a layer of full causal attention."""
        if self.windowed_layers is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if windowed else None for windowed in self.windowed_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> "ModelConfig":
        """The same model cut to its first `num_layers` layers (tests, tools)."""
        windowed = None if self.windowed_layers is None else self.windowed_layers[:num_layers]
        return dataclasses.replace(self, num_layers=num_layers, windowed_layers=windowed)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def rope_scaling_from_hf(params: Mapping[str, Any] | None, path) -> RopeScaling | None:
    """Read HF's `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
            int(params.get("original_max_position_embeddings", 8192)),
        )
    raise CheckpointError(path, f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def sliding_window_from_hf(cfg: Mapping[str, Any], arch: str, num_layers: int,
                           path) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window, windowed_layers) as transformers applies them: Mistral windows every
    layer; Qwen2/Qwen3 only with `use_sliding_window`, and then only the layers `layer_types`
    names "sliding_attention" (derived when absent: the layers from `max_window_layers` on);
    Llama never. No windowed layer gives (None, None); all of them (window, None)."""
    window = cfg.get("sliding_window")
    if not window or arch == "llama" or (arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window")):
        return None, None
    if arch == "mistral":  # (transformers' Mistral ignores layer_types)
        return int(window), None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.get("max_window_layers")
        first = 28 if first is None else int(first)  # transformers' default
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise CheckpointError(path, f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise CheckpointError(path, f"layer type {unknown[0]!r} is not supported (full_attention, sliding_attention)")
    windowed = tuple(t == "sliding_attention" for t in layer_types)
    if not any(windowed):
        return None, None
    return int(window), None if all(windowed) else windowed


def config_from_hf(cfg: Mapping[str, Any], path) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json`; `path` is named in errors."""
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            path, f"architecture {archs!r} is not supported (expected one of {sorted(HF_ARCHITECTURES)})"
        )
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta = cfg.get("rope_theta") or (rope_params or {}).get("rope_theta") or 10000.0
        num_layers = int(cfg["num_hidden_layers"])
        window, windowed_layers = sliding_window_from_hf(cfg, arch, num_layers, path)
        if cfg.get("mlp_bias") or (arch != "qwen2" and cfg.get("attention_bias")):
            raise CheckpointError(path, "attention_bias/mlp_bias on this architecture is not supported")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling_from_hf(rope_params, path),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            sliding_window=window,
            windowed_layers=windowed_layers,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(path, f"config is missing or has a bad field: {exc!r}") from exc
