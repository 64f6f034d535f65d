"""The torch reference attention backend: gather each sequence's pages, then SDPA with a mask.

Runs on any device and is the oracle the fast backends are tested against. It loops over
the sequences of a step on the host, which is fine for a reference and for small CPU batches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanoinfer.batch import Batch
from nanoinfer.config import ModelConfig


class SeqView(NamedTuple):
    """Where one sequence's queries sit in the step, and what they may attend to."""

    query_start: int
    query_end: int
    block_ids: torch.Tensor  # [blocks covering the context] physical block ids
    context_len: int
    mask: torch.Tensor | None  # [queries, context_len] bool; None = attend to everything


class ReferenceMetadata(NamedTuple):
    seqs: tuple[SeqView, ...]
    scale: float


class ReferenceAttention:
    """Stateless; one instance serves every model."""

    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None) -> ReferenceMetadata:
        starts = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        device = batch.input_ids.device
        seqs = []
        for s, context_len in enumerate(seq_lens):
            start, end = starts[s], starts[s + 1]
            n = end - start
            # Query i of this chunk sits at position context_len - n + i; it sees keys at
            # positions <= its own, and within the sliding window when the layer has one.
            mask = None
            if n > 1 or window is not None:
                q_pos = torch.arange(context_len - n, context_len, device=device)[:, None]
                k_pos = torch.arange(context_len, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            seqs.append(SeqView(start, end, batch.block_tables[s], context_len, mask))
        return ReferenceMetadata(tuple(seqs), cfg.head_dim**-0.5)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # Flat views [num_blocks * block_size, kv_heads, head_dim]: a slot is one row.
        _, num_blocks, block_size, kv_heads, head_dim = kv_layer.shape
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        kv_layer[0].view(-1, kv_heads, head_dim)[slots] = k[valid]
        kv_layer[1].view(-1, kv_heads, head_dim)[slots] = v[valid]

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, metadata: ReferenceMetadata) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; padding rows past the last sequence stay zero.
        out = torch.zeros_like(q)
        _, _, block_size, kv_heads, head_dim = kv_layer.shape
        for seq in metadata.seqs:
            if seq.query_end == seq.query_start:
                continue
            num_blocks = -(-seq.context_len // block_size)
            pages = seq.block_ids[:num_blocks].long()
            # k, v: [kv_heads, context, head_dim] after the gather
            k = kv_layer[0].index_select(0, pages).reshape(-1, kv_heads, head_dim)[: seq.context_len]
            v = kv_layer[1].index_select(0, pages).reshape(-1, kv_heads, head_dim)[: seq.context_len]
            o = F.scaled_dot_product_attention(
                q[seq.query_start : seq.query_end].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=seq.mask,
                scale=metadata.scale,
                enable_gqa=True,
            )
            out[seq.query_start : seq.query_end] = o.transpose(0, 1)
        return out


REFERENCE = ReferenceAttention()
