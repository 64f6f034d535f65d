"""A packed model's layers on the CPU: a whole layer in one C call, or packed matmuls and one fused call per piece.

A decode step of the default model (SmolLM2-135M, Q4_1) in torch ops is ~1,900 ops of 2–5 µs
around 121 packed matmuls. Where every projection is a BlockWeight, a layer is one call into
cpu_native.c (`block_layer_forward`; K-quant super-blocks too, and fused matrices of
mixed types); otherwise (torch's int4/int8 kernels) it is four matmuls
and five calls (norm, RoPE + KV write, attention, residual + norm, SwiGLU), whose bf16 outputs
feed the matmuls directly. The one call runs the same C functions as the pieces, so the same
bits: it only saves their Python and ctypes overhead, which at decode had cost about as long
as the matmuls. Activations between layers stay fp32, the KV pool fp32: the same
arithmetic as the torch path (`rope_write_cpu` with `TorchPagedAttention`), which stays the
reference (tests/test_cpu_native.py holds the two together) and which runs whatever this
does not take: dense weights, another KV dtype, no C compiler.

Every call here computes a row by the same arithmetic whatever rows share it (a prefill
chunk, a decode step, a verification's rows; tests/test_cpu_determinism.py): the matmuls
round activations to int8 per group, which turns any last-bit difference into another
rounding step, and so greedy text would depend on how a token was scheduled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant import quantized
from nanoinfer.quant.grouped import GroupedWeight
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.backends.cpu.cpu_native import CpuNative, check_attention_tables
from nanoinfer.model.layers import rope_cos_sin
from nanoinfer.model.decoder import EAGER, LayerFunctions, LayerParams, Params


def takes(params: Params, kv_dtype: torch.dtype) -> bool:
    """Whether these layers can run the model: fp32 activations and KV, every projection packed."""
    packed = (quantized.BlockWeight, quantized.Int4Weight, quantized.SplitInt8Weight, quantized.Int8Weight,
              quantized.KQuantWeight, quantized.StackedWeight)
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
                                 linear=None, reduce=EAGER.all_reduce) -> torch.Tensor:
        def row_parallel(rows: torch.Tensor, w) -> torch.Tensor:
            if reduce is EAGER.all_reduce:  # (one rank)
                return quantized.packed_matmul(rows, w)
            # Tensor-parallel ranks add their partial outputs in fp32 (cpu_native's matmuls:
            # unrounded), then round the sum to bf16 once, as one rank rounds its whole output.
            return reduce(quantized.packed_matmul(rows, w, torch.float32)).to(torch.bfloat16)

        o = row_parallel(attn.view(x.shape[0], cfg.q_size).to(torch.bfloat16), lp.o_proj)
        x, h = native.add_rms_norm_bf16(x, o.contiguous(), lp.mlp_norm, cfg.rms_norm_eps)
        gate_up = quantized.packed_matmul(h, lp.gate_up_proj).contiguous()
        return x.add_(row_parallel(native.silu_mul_bf16(gate_up), lp.down_proj))

    structs: dict[int, tuple[LayerParams, cpu_native.BlockLayer]] = {}  # id(lp) -> (lp kept alive, its pointers)

    def layer(x: torch.Tensor, lp: LayerParams, cos, sin, kv_layer: torch.Tensor, meta: "NativeAttentionMetadata",
              cfg: ModelConfig) -> torch.Tensor:
        entry = structs.get(id(lp))
        if entry is None or entry[0] is not lp:
            if not all(takes_whole(getattr(lp, f)) for f in BLOCK_FIELDS):
                entry = (lp, None)  # (torch's packed kernels: one call per piece)
            else:
                entry = (lp, cpu_native.block_layer(lp))
            structs[id(lp)] = entry
        if entry[1] is not None:
            return native.block_layer_forward(entry[1], meta.step, cos, sin, kv_layer, x)
        qkv = qkv_projection(x, lp, cfg)
        q = rope_and_write(qkv, lp.q_norm, lp.k_norm, cos, sin, kv_layer, meta.slot_mapping, cfg)
        attn = native.paged_attention(q, kv_layer, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      meta.window, meta.scale)
        return attention_output_and_mlp(x, attn, lp, cfg)

    def qkv_rope_and_write(x, lp: LayerParams, cfg: ModelConfig, linear, cos, sin, kv_layer, slot_mapping):
        return rope_and_write(qkv_projection(x, lp, cfg), lp.q_norm, lp.k_norm, cos, sin, kv_layer, slot_mapping, cfg)

    def embed(table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # (a K-quant or grouped table's rows unpacked in C: cpu_native.kquant_rows, cpu_native.group_rows)
        if isinstance(table, quantized.KQuantWeight):
            return cpu_native.kquant_rows(table, ids.reshape(-1), native.lib).reshape(*ids.shape, -1).to(dtype)
        if isinstance(table, GroupedWeight) and cpu_native.takes_group_rows(table):
            return cpu_native.group_rows(table, ids.reshape(-1), native.lib).reshape(*ids.shape, -1).to(dtype)
        return quantized.embedding(table, ids, dtype)

    return LayerFunctions(attention_output_and_mlp=attention_output_and_mlp, qkv_rope_and_write=qkv_rope_and_write,
                          rope_tables=rope_cos_sin, layer=layer, embed=embed)


BLOCK_FIELDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def takes_whole(w) -> bool:
    """Whether block_layer_forward multiplies `w`: group blocks, K-quant super-blocks, or a
    stack of them (a fused matrix of mixed types: its segments one after another)."""
    if isinstance(w, quantized.StackedWeight):
        return all(takes_whole(p) for p in w.parts)
    return isinstance(w, (quantized.BlockWeight, quantized.KQuantWeight))


class NativeAttentionMetadata(NamedTuple):
    """What the C kernel reads of a step: the batch's own tables."""

    block_tables: torch.Tensor  # [seqs, width] int32
    seq_lens: torch.Tensor  # [seqs] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    window: int | None
    scale: float
    slot_mapping: torch.Tensor  # [tokens] int64
    step: cpu_native.BlockStep  # the same, for a whole-layer call (its pointers: the tensors above)


class NativeAttention:
    """Every query row of a step, prefill chunks' and decodes' alike, in one C call per layer
    (cpu_native.c's paged_attention), by one routine per row: a token's attention output, and
    so the int8 rounding of the matmuls after it, is the same bits in any chunk or batch."""

    def __init__(self, block_size: int, native: CpuNative):
        self.block_size = block_size
        self.native = native

    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None) -> NativeAttentionMetadata:
        check_attention_tables(batch.block_tables, batch.seq_lens, batch.query_start_loc)
        slots = batch.slot_mapping.contiguous()
        step = cpu_native.BlockStep(
            tokens=slots.shape[0], hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            d=cfg.head_dim, seqs=batch.seq_lens.shape[0], block_size=self.block_size, window=window or 0,
            threads=torch.get_num_threads(), eps=cfg.rms_norm_eps, scale=cfg.softmax_scale, slots=slots.data_ptr(),
            tables=batch.block_tables.data_ptr(), lens=batch.seq_lens.data_ptr(),
            query_start=batch.query_start_loc.data_ptr(), table_stride=batch.block_tables.stride(0))
        return NativeAttentionMetadata(batch.block_tables, batch.seq_lens, batch.query_start_loc, window,
                                       cfg.softmax_scale, slots, step)

    def write_kv(self, kv_layer, k, v, slot_mapping) -> None:  # (the layers write with `rope_and_write`)
        from nanoinfer.attention.reference import REFERENCE

        REFERENCE.write_kv(kv_layer, k, v, slot_mapping)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: NativeAttentionMetadata) -> torch.Tensor:
        return self.native.paged_attention(q.contiguous(), kv_layer, meta.block_tables, meta.seq_lens,
                                           meta.query_start_loc, meta.window, meta.scale)
