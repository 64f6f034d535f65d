"""Batched torch attention for the CPU: all single-token (decode) rows of a step in one set
of tensor ops, prefill chunks through the reference. Tested against the reference.

The reference loops over sequences, which at a batch of decodes costs a dozen small ops per
sequence per layer. Decode rows need no causal mask, only a length mask, so they batch well:
gather every decoding sequence's pages at once, padded to the longest context.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoinfer.attention.reference import REFERENCE, ReferenceMetadata
from nanoinfer.batch import Batch
from nanoinfer.config import ModelConfig


class DecodeGroup(NamedTuple):
    rows: torch.Tensor  # [decodes] the query row of each decoding sequence
    block_tables: torch.Tensor  # [decodes, blocks] int64, pages covering the longest context
    key_mask: torch.Tensor  # [decodes, blocks * block_size_or_more] bool: key position is visible


class TorchPagedMetadata(NamedTuple):
    decodes: DecodeGroup | None
    prefills: ReferenceMetadata  # the sequences with several query rows, for the reference
    scale: float


class TorchPagedAttention:
    def __init__(self, block_size: int):
        self.block_size = block_size

    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None) -> TorchPagedMetadata:
        ref = REFERENCE.prepare(batch, cfg, window)
        decodes = [s for s in ref.seqs if s.query_end - s.query_start == 1]
        others = tuple(s for s in ref.seqs if s.query_end - s.query_start != 1)
        group = None
        if decodes:
            device = batch.input_ids.device
            lens = torch.tensor([s.context_len for s in decodes], device=device)
            blocks = -(-max(s.context_len for s in decodes) // self.block_size)
            tables = torch.stack([s.block_ids[:blocks] for s in decodes]).long()
            positions = torch.arange(blocks * self.block_size, device=device)
            visible = positions[None, :] < lens[:, None]
            if window is not None:  # the query sits at position len - 1
                visible &= positions[None, :] > (lens[:, None] - 1 - window)
            rows = torch.tensor([s.query_start for s in decodes], device=device)
            group = DecodeGroup(rows, tables, visible)
        return TorchPagedMetadata(group, ReferenceMetadata(others, ref.scale, window), ref.scale)

    def write_kv(self, kv_layer, k, v, slot_mapping) -> None:
        REFERENCE.write_kv(kv_layer, k, v, slot_mapping)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: TorchPagedMetadata) -> torch.Tensor:
        out = REFERENCE.attention(q, kv_layer, meta.prefills)
        group = meta.decodes
        if group is None:
            return out
        _, _, block_size, kv_heads, head_dim = kv_layer.shape
        n, heads = group.rows.shape[0], q.shape[1]
        # k, v: [decodes, kv_heads, context, head_dim]; q: [decodes, kv_heads, group, head_dim]
        k = kv_layer[0][group.block_tables].reshape(n, -1, kv_heads, head_dim).transpose(1, 2)
        v = kv_layer[1][group.block_tables].reshape(n, -1, kv_heads, head_dim)
        # A masked slot may hold anything (a block's unwritten tail, a padding table entry, a
        # freed block): its score becomes -inf and its value 0, as probability 0 * NaN is NaN.
        v = v.masked_fill_(~group.key_mask[:, :, None, None], 0.0).transpose(1, 2)
        qg = q[group.rows].reshape(n, kv_heads, heads // kv_heads, head_dim)
        scores = (qg @ k.transpose(-1, -2)).float() * meta.scale  # [decodes, kv_heads, group, context]
        scores = scores.masked_fill(~group.key_mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype)
        out[group.rows] = (probs @ v).reshape(n, heads, head_dim)
        return out
