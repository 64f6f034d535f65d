"""The decoder-only transformer as a pure function: forward(params, kv, batch, cfg) -> logits.

One function serves Llama, Mistral, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm), Phi-3, Gemma 2/3
(scaled embedding, sandwich norms, GeGLU, soft-capped logits, a RoPE base of the windowed layers'
own), Mixtral and Qwen3-MoE (a sparse layer's MLP the mixture of experts: nanoinfer/model/moe.py, imported
by such a model only): they differ only by ModelConfig flags. Parameters are a pytree of frozen dataclasses, not nn.Modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from nanoinfer.quant import quantized
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.layers import apply_rope, gated_activation, rms_norm, rope_cos_sin, softcap, swiglu
from nanoinfer.quant.quantized import Weight, embedding, map_weight

if TYPE_CHECKING:
    from nanoinfer.attention import AttentionBackend
    from nanoinfer.model.moe import MoEParams


@dataclass(frozen=True)
class LayerParams:
    """A layer's weights. The projections (`Weight`) are dense [out, in] tensors or quantized
    matrices (nanoinfer.quant.quantized); norms and biases are always dense, in the model's dtype."""

    attn_norm: torch.Tensor  # [hidden]
    qkv_proj: Weight  # [q_size + 2 * kv_size, hidden], q, k, v stacked: one matmul
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    o_proj: Weight  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up_proj: Weight | None  # [2 * intermediate, hidden], gate then up: one matmul (None: a sparse layer)
    down_proj: Weight | None  # [hidden, intermediate]
    post_attn_norm: torch.Tensor | None = None  # [hidden] (Gemma's sandwich norms: the attention's output)
    post_mlp_norm: torch.Tensor | None = None  # [hidden] (and the MLP's)
    moe: MoEParams | None = None  # a sparse layer's router and experts, in place of the MLP's two projections


@dataclass(frozen=True)
class Params:
    embed: Weight | None  # [vocab, hidden]: dense, or a quantized table rows are read from (None: a later stage)
    layers: tuple[LayerParams, ...]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Weight | None  # [vocab, hidden]; the same object as `embed` when tied and dense (None: an earlier stage)
    rope_inv_freq: torch.Tensor  # [head_dim // 2] fp32, scaling applied
    rope_local_inv_freq: torch.Tensor | None = None  # [head_dim // 2] fp32 of windowed layers (Gemma 3); None: the same

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a quantized model's matrices hold other types)."""
        return self.final_norm.dtype

    @property
    def device(self) -> torch.device:
        return self.final_norm.device


def map_params(fn: Callable[[torch.Tensor], torch.Tensor], params: Params) -> Params:
    """Apply `fn` to every tensor of the pytree, a quantized matrix's parts included (keeps
    tied weights tied)."""
    memo: dict[int, object] = {}

    def apply(t):
        if t is None:
            return None
        if id(t) not in memo:
            memo[id(t)] = map_weight(fn, t)
        return memo[id(t)]

    def apply_all(obj):
        return dataclasses.replace(obj, **{f.name: apply(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.name != "layers"})

    layers = tuple(apply_all(layer) for layer in params.layers)
    return dataclasses.replace(apply_all(params), layers=layers)


def qkv_projection(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear: Callable = quantized.linear) -> torch.Tensor:
    """Norm and the stacked QKV projection: [tokens, q_size + 2 * kv_size]."""
    return linear(rms_norm(x, lp.attn_norm, cfg.rms_norm_eps), lp.qkv_proj, lp.qkv_bias)


def attention_inputs(x: torch.Tensor, lp: LayerParams, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig,
                     linear: Callable = quantized.linear):
    """Norm, QKV projection, q/k norm and RoPE: q [tokens, heads, dim], k and v [tokens, kv_heads, dim]."""
    tokens = x.shape[0]
    qkv = qkv_projection(x, lp, cfg, linear)
    q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
    q = q.reshape(tokens, cfg.num_heads, cfg.head_dim)
    k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class RankSum:
    """A sum over tensor-parallel ranks after a row-parallel projection (LayerFunctions.all_reduce),
    and whether this rank leads. A part that adds the residual inside the projection's kernel
    (nanoinfer.backends.cuda.fused_layers) adds it on the lead rank only, so that the sum carries it once."""

    sum: Callable[[torch.Tensor], torch.Tensor]
    lead: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x)


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig,
                             linear: Callable = quantized.linear, reduce: Callable = _same) -> torch.Tensor:
    """The rest of the layer: output projection, residual, norm, gated MLP (SwiGLU; Gemma's GeGLU; a sparse
    layer's mixture of experts), residual;
    with sandwich norms (Gemma) each sublayer's output is normed before its residual add.
    `reduce` sums the row-parallel projections' partial outputs over tensor-parallel ranks."""
    if cfg.sandwich_norms:
        o = reduce(linear(attn.reshape(x.shape[0], cfg.q_size), lp.o_proj))
        x = x + rms_norm(o, lp.post_attn_norm, cfg.rms_norm_eps)
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        down = reduce(linear(gated_activation(linear(h, lp.gate_up_proj), cfg), lp.down_proj))
        return x + rms_norm(down, lp.post_mlp_norm, cfg.rms_norm_eps)
    x = x + reduce(linear(attn.reshape(x.shape[0], cfg.q_size), lp.o_proj))
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    if lp.moe is not None:  # (a sparse layer: its module imported by a mixture-of-experts model's first step)
        from nanoinfer.model.moe import moe_mlp

        return x + reduce(moe_mlp(h, lp.moe, cfg))
    return x + reduce(linear(swiglu(linear(h, lp.gate_up_proj)), lp.down_proj))


class LayerFunctions(NamedTuple):
    """The dense parts of a layer; attention sits between them. Swapping in fused versions
    (CUDA: nanoinfer.backends.choose.cuda_layer_functions) saves the dozens of small element-wise
    kernels a layer otherwise launches, without touching the attention backend's kernels. `linear`
    computes every projection (`quantized.linear`: any weight form; CUDA uses
    nanoinfer.backends.cuda.linear.linear: a Triton GEMV at batch 1), `lm_head` the logits (`quantized.lm_head`:
    `linear`, without the bf16 rounding of a CPU packed kernel's output; CUDA's `linear`).
    `qkv_rope_and_write` (CUDA: nanoinfer.backends.cuda.fused_layers; CPU: nanoinfer.backends.cpu.rope_write_cpu),
    (x, lp, cfg, linear, cos, sin, kv_layer, slot_mapping) -> q, replaces `attention_inputs` and
    the backend's KV write; `rope_tables` makes the cos and sin tables, once a step, in the form
    it takes."""

    attention_inputs: Callable = attention_inputs
    attention_output_and_mlp: Callable = attention_output_and_mlp
    linear: Callable = quantized.linear
    lm_head: Callable = quantized.lm_head
    qkv_rope_and_write: Callable | None = None
    rope_tables: Callable = rope_cos_sin
    # A whole layer in one call, in place of the four above and the backend's attention
    # (the CPU's fused layers: nanoinfer.backends.cpu.cpu_layers), or None.
    layer: Callable | None = None
    # Tensor parallelism (nanoinfer/parallel/shards.py): the sum over ranks after a
    # row-parallel projection, the vocab-parallel embedding, and the logits' gather.
    all_reduce: Callable = _same
    embed: Callable = embedding
    gather_logits: Callable = _same
    # The final norm before the LM head (CUDA's deterministic mode: a kernel of one program per row,
    # nanoinfer.backends.cuda.invariant; torch's reduction picks its order by the row count).
    norm: Callable = rms_norm


EAGER = LayerFunctions()


def forward(
    params: Params,
    kv: torch.Tensor,
    batch: Batch,
    cfg: ModelConfig,
    backend: AttentionBackend | None = None,
    layer_fns: LayerFunctions = EAGER,
    logits_dtype: torch.dtype | None = torch.float32,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [len(batch.logits_indices), vocab] for the batch's sampling rows, in
    `logits_dtype` (None: the model's own dtype, which a greedy step needs no more than).
    `backend` None: the reference attention (nanoinfer/attention/reference.py).

    A pipeline stage (nanoinfer/parallel/pipeline.py: params of some layers) takes the previous
    stage's activations as `hidden` where it has no embedding, and returns its activations
    [tokens, hidden] where it has no LM head.

    Side effect: writes this step's keys and values into `kv` at `batch.slot_mapping`, the
    slots the batch owns, and nowhere else. Returning a fresh pool instead would copy the
    whole cache every step (see DESIGN.md §2); `forward_out_of_place` is that mode for tests.
    """
    if cfg.architecture == "nanochat":  # (a dataflow of its own: nanoinfer.backends.choose.forward_of picks it)
        raise ValueError("a nanochat model runs nanoinfer.model.nanochat.forward (see nanoinfer.backends.choose.forward_of)")
    if backend is None:
        from nanoinfer.attention.reference import REFERENCE

        backend = REFERENCE
    windows = cfg.layer_windows
    # One metadata per kind of layer: a model that windows some layers only prepares two.
    meta = {window: backend.prepare(batch, cfg, window) for window in dict.fromkeys(windows)}
    x = layer_fns.embed(params.embed, batch.input_ids, params.dtype) if hidden is None else hidden  # [tokens, hidden]
    if cfg.embed_scale is not None and hidden is None:  # (Gemma: rounded to the activations' dtype first, as theirs;
        # a Python number, so that a CUDA graph's capture copies nothing from the host)
        x = x * float(torch.tensor(cfg.embed_scale, dtype=x.dtype))
    rope = layer_fns.rope_tables(params.rope_inv_freq, batch.positions, x.dtype)
    local_rope = rope if params.rope_local_inv_freq is None else layer_fns.rope_tables(
        params.rope_local_inv_freq, batch.positions, x.dtype)
    for layer_idx, lp in enumerate(params.layers):
        cos, sin = rope if windows[layer_idx] is None else local_rope
        if layer_fns.layer is not None:
            x = layer_fns.layer(x, lp, cos, sin, kv[layer_idx], meta[windows[layer_idx]], cfg)
            continue
        if layer_fns.qkv_rope_and_write is None:
            q, k, v = layer_fns.attention_inputs(x, lp, cos, sin, cfg, layer_fns.linear)
            backend.write_kv(kv[layer_idx], k, v, batch.slot_mapping)
        else:  # (the pool's layout is kv_cache.py's, whatever the backend)
            q = layer_fns.qkv_rope_and_write(x, lp, cfg, layer_fns.linear, cos, sin, kv[layer_idx], batch.slot_mapping)
        attn = backend.attention(q, kv[layer_idx], meta[windows[layer_idx]])  # [tokens, heads, head_dim]
        x = layer_fns.attention_output_and_mlp(x, attn, lp, cfg, layer_fns.linear, layer_fns.all_reduce)
    if params.lm_head is None:  # a stage before the last: its activations are the next stage's input
        return x
    # Only the rows that sample pay for the final norm and the LM head.
    x = layer_fns.norm(x[batch.logits_indices], params.final_norm, cfg.rms_norm_eps)
    logits = layer_fns.gather_logits(layer_fns.lm_head(x, params.lm_head))
    if cfg.final_softcap is not None:
        logits = softcap(logits, cfg.final_softcap)
    return logits if logits_dtype is None else logits.to(logits_dtype)


def forward_out_of_place(
    params: Params, kv: torch.Tensor, batch: Batch, cfg: ModelConfig, backend: AttentionBackend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The purely functional reference mode: (logits, new_kv), `kv` left untouched.
    Copies the whole pool, so it is for tests only."""
    new_kv = kv.clone()
    logits = forward(params, new_kv, batch, cfg, backend)
    return logits, new_kv
