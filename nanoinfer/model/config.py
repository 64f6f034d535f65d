"""ModelConfig: the frozen description of a model's shapes and numerics (each format's loader fills it in)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from nanoinfer.errors import CheckpointError
from nanoinfer.model.config_checks import MAX_DIMENSIONS, dimension, positive_number, token_id


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear", "llama3" (Llama-3.1's wavelength-band
    interpolation: the freq factors) or "longrope" (Phi-3's: a divisor per frequency, `short_factor`
    within the original context and `long_factor` past it, and cos and sin scaled by
    `attention_factor`); `original_max_position_embeddings` is the context trained before scaling."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self):
        positive_number("rope scaling factor", self.factor)
        if self.kind == "llama3":  # (its smoothing divides by the two factors' difference)
            positive_number("rope scaling low_freq_factor", self.low_freq_factor)
            positive_number("rope scaling high_freq_factor", self.high_freq_factor)
            dimension("rope scaling original_max_position_embeddings", self.original_max_position_embeddings)
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(f"rope scaling high_freq_factor={self.high_freq_factor!r} is not above "
                                 f"low_freq_factor={self.low_freq_factor!r}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "gemma2" | "gemma3" | "mixtral" | "qwen3_moe" | "nanochat"
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
    # RoPE over the first rotary_dim of each head (Phi-4-mini); None: all of it. The loader reorders q's and k's
    # rows so that those pairs sit where rotate-half pairs them, and the others get frequency 0 (no rotation).
    rotary_dim: int | None = None
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
    # Gemma 2/3 (each off by default; a model without them runs none of their code):
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # the embedding times this (sqrt(hidden)), in the activations' dtype
    sandwich_norms: bool = False  # each sublayer's output normed before its residual add (post_*_norm)
    attn_softcap: float | None = None  # attention scores -> tanh(s / c) * c before the softmax
    final_softcap: float | None = None  # the logits -> tanh(l / c) * c
    query_pre_attn_scalar: float | None = None  # attention's scale is its -1/2 power (None: head_dim's)
    rope_local_theta: float | None = None  # windowed layers' RoPE base, unscaled (None: rope_theta's, scaled)
    # Mixture of experts (Mixtral, Qwen3-MoE; 0 experts: a dense model, which runs none of nanoinfer/model/moe.py):
    num_experts: int = 0  # experts of each sparse layer's MLP
    experts_per_token: int = 0  # k: the experts a token is routed to
    moe_intermediate_size: int | None = None  # an expert's inner width (None: intermediate_size, as Mixtral's)
    norm_topk_prob: bool = True  # the k routing weights renormalized to sum to 1 (Mixtral always; Qwen3-MoE's flag)
    sparse_layers: tuple[bool, ...] | None = None  # per layer: its MLP the experts'? (None: every layer, given experts)

    def __post_init__(self):
        """Every loader's config meets these, whatever its file says (a ValueError naming the field)."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            dimension(name, getattr(self, name), most=MAX_DIMENSIONS.get(name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}: "
                             "each KV head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: RoPE rotates a head's dimensions in pairs")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim={self.rotary_dim}: expected an even number from 2 to head_dim "
                             f"({self.head_dim})")
        positive_number("rms_norm_eps", self.rms_norm_eps)
        positive_number("rope_theta", self.rope_theta)
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported: expected 'silu' or 'gelu_tanh'")
        for name in ("embed_scale", "attn_softcap", "final_softcap", "query_pre_attn_scalar", "rope_local_theta"):
            if getattr(self, name) is not None:
                positive_number(name, getattr(self, name))
        if self.sliding_window is not None:
            dimension("sliding_window", self.sliding_window)
        if self.bos_token_id is not None:
            token_id("bos_token_id", self.bos_token_id)
        for eos in self.eos_token_ids:
            token_id("eos_token_ids", eos)
        if self.windowed_layers is not None and len(self.windowed_layers) != self.num_layers:
            raise ValueError(f"windowed_layers has {len(self.windowed_layers)} entries for {self.num_layers} layers")
        if self.num_experts:
            self._check_experts()
        scaling = self.rope_scaling
        if scaling is not None and scaling.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(scaling, name)
                rotated = self.rotary_dim or self.head_dim
                if len(factors) != rotated // 2 or not all(f > 0 for f in factors):
                    raise ValueError(f"rope scaling {name} has {len(factors)} entries: expected the rotated "
                                     f"dimensions / 2 = {rotated // 2} positive numbers")
            positive_number("rope scaling attention_factor", scaling.attention_factor)

    def _check_experts(self) -> None:
        dimension("num_experts", self.num_experts, most=MAX_DIMENSIONS["num_experts"])
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token!r} is not within 1..num_experts="
                             f"{self.num_experts}: each token is routed to that many of the experts")
        dimension("moe_intermediate_size", self.expert_intermediate_size, most=MAX_DIMENSIONS["moe_intermediate_size"])
        if self.sparse_layers is not None and len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers")

    @property
    def expert_intermediate_size(self) -> int:
        """An expert's inner width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def layer_sparse(self) -> tuple[bool, ...]:
        """Each layer: whether its MLP is the mixture of experts (all False for a dense model)."""
        if not self.num_experts:
            return (False,) * self.num_layers
        return self.sparse_layers or (True,) * self.num_layers

    @property
    def softmax_scale(self) -> float:
        """Attention's scale of q.k: 1/sqrt(head_dim) (Gemma's: 1/sqrt(query_pre_attn_scalar)), times longrope's
        attention factor squared (it scales cos and sin, so q and k each; applied here once, the rotation itself
        stays a rotation)."""
        scaling = self.rope_scaling
        factor = scaling.attention_factor if scaling is not None and scaling.kind == "longrope" else 1.0
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * factor * factor

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
        sparse = None if self.sparse_layers is None else self.sparse_layers[:num_layers]
        return dataclasses.replace(self, num_layers=num_layers, windowed_layers=windowed, sparse_layers=sparse)


def checkpoint_config(path: str | Path, **fields) -> ModelConfig:
    """ModelConfig(**fields) as the checkpoint at `path` describes it: a value it refuses is a
    CheckpointError naming the file (each loader's one way to build its config)."""
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise CheckpointError(path, f"describes no usable model: {exc}") from exc
