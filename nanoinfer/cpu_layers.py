"""A packed model's layers on the CPU: torch's packed matmuls, and between them one fused call per piece.

A decode step of the default model (SmolLM2-135M, Q4_1) in torch ops is ~1,900 ops of 2–5 µs
around 121 packed matmuls; here a layer is four matmuls and five calls into cpu_native.c
(norm, RoPE + KV write, decode attention, residual + norm, SwiGLU), whose bf16 outputs feed
the matmuls directly. Activations between layers stay fp32, the KV pool fp32: the same
arithmetic as the torch path (`rope_write_cpu` with `TorchPagedAttention`), which stays the
reference (tests/test_cpu_native.py holds the two together) and which runs whatever this
does not take: dense weights, another KV dtype, prefill chunks' attention, no C compiler.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoinfer import quantized
from nanoinfer.attention.reference import REFERENCE
from nanoinfer.attention.torch_paged import TorchPagedAttention
from nanoinfer.batch import Batch
from nanoinfer.config import ModelConfig
from nanoinfer.cpu_native import CpuNative
from nanoinfer.layers import rope_cos_sin
from nanoinfer.model import LayerFunctions, LayerParams, Params


def takes(params: Params, kv_dtype: torch.dtype) -> bool:
    """Whether these layers can run the model: fp32 activations and KV, every projection packed."""
    packed = quantized.BlockWeight, quantized.Int4Weight, quantized.SplitInt8Weight, quantized.Int8Weight
    return (params.dtype == torch.float32 and kv_dtype == torch.float32
            and all(isinstance(getattr(lp, f), packed) for lp in params.layers
                    for f in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))


def layer_functions(native: CpuNative) -> LayerFunctions:
    def qkv_projection(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear=None) -> torch.Tensor:
        qkv = quantized.packed_matmul(native.rms_norm_bf16(x, lp.attn_norm, cfg.rms_norm_eps), lp.qkv_proj)
        return qkv if lp.qkv_bias is None else qkv.float() + lp.qkv_bias  # (as `linear` adds it: in fp32)

    def rope_and_write(qkv, q_norm, k_norm, cos, sin, kv_layer, slot_mapping, cfg: ModelConfig) -> torch.Tensor:
        return native.rope_write(qkv.contiguous(), q_norm, k_norm, cfg.rms_norm_eps, cos, sin, slot_mapping,
                                 kv_layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig,
                                 linear=None, reduce=lambda t: t) -> torch.Tensor:
        o = reduce(quantized.packed_matmul(attn.view(x.shape[0], cfg.q_size).to(torch.bfloat16), lp.o_proj))
        x, h = native.add_rms_norm_bf16(x, o.contiguous(), lp.mlp_norm, cfg.rms_norm_eps)
        gate_up = quantized.packed_matmul(h, lp.gate_up_proj).contiguous()
        return x.add_(reduce(quantized.packed_matmul(native.silu_mul_bf16(gate_up), lp.down_proj)))

    return LayerFunctions(attention_output_and_mlp=attention_output_and_mlp, qkv_projection=qkv_projection,
                          rope_and_write=rope_and_write, rope_tables=rope_cos_sin)


class NativeDecodes(NamedTuple):
    """A step whose every row is a decode: the C kernel reads the batch's own tables."""

    block_tables: torch.Tensor  # [seqs, width] int32
    seq_lens: torch.Tensor  # [seqs] int32
    window: int | None
    scale: float


class NativeDecodeAttention(TorchPagedAttention):
    """Decode rows attend in one C call per layer. A step of decodes only needs no metadata
    but the batch's block tables; a step with prefill chunks takes TorchPagedAttention's
    (its decode rows' slots; the chunks go through the reference)."""

    def __init__(self, block_size: int, native: CpuNative):
        super().__init__(block_size)
        self.native = native
        # scratch for the longest context seen: its slots, and one KV head's scores
        self.slots, self.scores = torch.empty(0, dtype=torch.int64), torch.empty(0)

    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None):
        if batch.num_tokens != batch.num_seqs:  # (every sequence has a token: then one each)
            return super().prepare(batch, cfg, window)
        keys = batch.block_tables.shape[1] * self.block_size
        if self.slots.numel() < keys:
            self.slots = torch.empty(2 * keys, dtype=torch.int64)
        self._scores_for(cfg.num_heads // cfg.num_kv_heads * keys)
        return NativeDecodes(batch.block_tables, batch.seq_lens, window, cfg.head_dim**-0.5)

    def _scores_for(self, need: int) -> torch.Tensor:
        if self.scores.numel() < need:
            self.scores = torch.empty(2 * need)
        return self.scores

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta) -> torch.Tensor:
        if isinstance(meta, NativeDecodes):
            return self.native.decode_attention_paged(q, kv_layer, meta.block_tables, meta.seq_lens, meta.window,
                                                      meta.scale, self.slots, self.scores)
        group = meta.decodes
        if group is None:
            return REFERENCE.attention(q, kv_layer, meta.prefills)
        out = torch.empty_like(q) if group.rows is None else REFERENCE.attention(q, kv_layer, meta.prefills)
        scores = self._scores_for(q.shape[1] // kv_layer.shape[-2] * group.slots.shape[1])
        self.native.decode_attention(q, kv_layer, group.slots, group.counts, group.rows, meta.scale, scores, out)
        return out
