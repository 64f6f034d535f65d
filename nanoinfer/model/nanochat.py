"""nanochat's transformer (karpathy/nanochat, gpt.py) as a forward over the paged KV pool.

Its dataflow differs from the Llama family's enough for a forward of its own; the parts
that are the same (the QKV and output projections, the attention backends and their KV
writes, RoPE) are shared. Per token, with x0 the embedding after the smear:

- embedding, then a parameter-free RMSNorm (every norm here has no weight; eps = fp32's);
- smear: x[t] += smear_lambda · sigmoid(smear_gate · x[t][:24]) · x[t-1], the previous
  token's normed embedding. It is read from the pool: two extra pool "layers" hold each
  token's normed embedding at its slot (ModelConfig.kv_extra_layers), so a decode step, a
  chunk of a prompt or a cached prefix reads its predecessor wherever it was computed;
- per layer i: x = resid_lambdas[i]·x + x0_lambdas[i]·x0, then attention on norm(x): RoPE
  by −θ (nanochat's rotation is the transpose of the usual: our RoPE with negated
  frequencies), then q and k RMS-normed and scaled by 1.2, GQA, causal, a sliding window on
  the "S" layers of `window_pattern`; on alternate layers (the last included) v gains a
  value embedding of the token, gated by 3·sigmoid(ve_gate · norm(x)[:12]) per KV head;
  then an MLP with ReLU² on norm(x);
- after layer n_layer // 2 its output is kept, and backout_lambda times it is subtracted
  before the final norm;
- the untied LM head over a vocabulary padded to a multiple of 64 (cropped), then logits
  soft-capped: 15·tanh(logits / 15), in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoinfer.attention import AttentionBackend
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.layers import apply_rope, rope_cos_sin
from nanoinfer.attention.reference import REFERENCE
from nanoinfer.model.decoder import EAGER, LayerFunctions, LayerParams, Params
from nanoinfer.quant.quantized import Weight, embedding

SOFTCAP = 15.0
QK_SCALE = 1.2
SMEAR_CHANNELS, VE_GATE_CHANNELS = 24, 12
ROPE_THETA = 100000.0


@dataclass(frozen=True)
class NanochatLayerParams(LayerParams):
    """A layer: the Llama fields hold nanochat's projections (qkv_proj: c_q, c_k, c_v;
    o_proj: attn.c_proj; gate_up_proj: mlp.c_fc; down_proj: mlp.c_proj; the norms are ones),
    plus its residual scalars and, on value-embedding layers, the table and its gate."""

    resid_lambda: torch.Tensor = None  # [1]
    x0_lambda: torch.Tensor = None  # [1]
    value_embed: Weight | None = None  # [padded vocab, kv_size]
    ve_gate: torch.Tensor | None = None  # [kv_heads, 12]


@dataclass(frozen=True)
class NanochatParams(Params):
    smear_gate: torch.Tensor = None  # [1, 24]
    smear_lambda: torch.Tensor = None  # [1]
    backout_lambda: torch.Tensor = None  # [1]


def extra_layers(cfg_hidden: int, kv_size: int) -> int:
    """Pool layers that one token's normed embedding takes (a layer holds 2 · kv_size values)."""
    return math.ceil(cfg_hidden / (2 * kv_size))


def _norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _smear(x: torch.Tensor, kv: torch.Tensor, batch: Batch, params: NanochatParams, cfg: ModelConfig,
           backend: AttentionBackend) -> torch.Tensor:
    """Each token's normed embedding written at its slot, then its predecessor's read back
    (this batch's own tokens included) and mixed in."""
    tokens, first = x.shape[0], cfg.num_layers
    width = 2 * cfg.kv_size
    parts = F.pad(x, (0, cfg.kv_extra_layers * width - x.shape[1])).view(
        tokens, cfg.kv_extra_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    for e in range(cfg.kv_extra_layers):
        backend.write_kv(kv[first + e], parts[:, e, 0], parts[:, e, 1], batch.slot_mapping)
    block_size = kv.shape[3]
    seq = torch.searchsorted(batch.query_start_loc[1:].to(torch.int64),
                             torch.arange(tokens, device=x.device), right=True)
    seq = seq.clamp(max=batch.block_tables.shape[0] - 1)  # (padding tokens past the last sequence)
    before = (batch.positions - 1).clamp(min=0)
    slots = batch.block_tables[seq, before // block_size].to(torch.int64) * block_size + before % block_size
    stored = kv[first:].flatten(2, 3)[:, :, slots]  # [extra, 2, tokens, kv_heads, head_dim]
    previous = stored.permute(2, 0, 1, 3, 4).reshape(tokens, -1)[:, :x.shape[1]].to(x.dtype)
    gate = params.smear_lambda * torch.sigmoid(F.linear(x[:, :SMEAR_CHANNELS], params.smear_gate))
    return x + gate * previous * (batch.positions > 0)[:, None].to(x.dtype)


def forward(params: NanochatParams, kv: torch.Tensor, batch: Batch, cfg: ModelConfig,
            backend: AttentionBackend = REFERENCE, layer_fns: LayerFunctions = EAGER,
            logits_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """nanoinfer.model.decoder.forward's counterpart for a nanochat model (nanoinfer.backends.choose.forward_of
    picks it): logits of the batch's sampling rows; writes the batch's keys, values and normed
    embeddings at its slots."""
    linear = layer_fns.linear
    eps, tokens = cfg.rms_norm_eps, batch.input_ids.shape[0]
    windows = cfg.layer_windows
    meta = {window: backend.prepare(batch, cfg, window) for window in dict.fromkeys(windows)}
    x = _norm(embedding(params.embed, batch.input_ids, params.dtype), eps)
    x = x0 = _smear(x, kv, batch, params, cfg, backend)
    cos, sin = rope_cos_sin(params.rope_inv_freq, batch.positions, x.dtype)
    backout = None
    for i, lp in enumerate(params.layers):
        x = lp.resid_lambda * x + lp.x0_lambda * x0
        h = _norm(x, eps)
        q, k, v = linear(h, lp.qkv_proj).split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = q.reshape(tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        if lp.value_embed is not None:
            gate = 3 * torch.sigmoid(F.linear(h[:, :VE_GATE_CHANNELS], lp.ve_gate))  # [tokens, kv_heads]
            ve = embedding(lp.value_embed, batch.input_ids, x.dtype).view(tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v + gate[..., None] * ve
        q = _norm(apply_rope(q, cos, sin), eps) * QK_SCALE
        k = _norm(apply_rope(k, cos, sin), eps) * QK_SCALE
        backend.write_kv(kv[i], k, v, batch.slot_mapping)
        attn = backend.attention(q, kv[i], meta[windows[i]])
        x = x + linear(attn.reshape(tokens, cfg.q_size), lp.o_proj)
        x = x + linear(F.relu(linear(_norm(x, eps), lp.gate_up_proj)).square(), lp.down_proj)
        if i == cfg.num_layers // 2:
            backout = x
    rows = batch.logits_indices
    x = _norm(x[rows] - params.backout_lambda * backout[rows], eps)
    logits = layer_fns.lm_head(x, params.lm_head)[:, :cfg.vocab_size].float()
    logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
    return logits.to(logits_dtype or params.dtype)
