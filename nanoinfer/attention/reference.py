"""The torch reference attention backend: gather each sequence's pages, then SDPA with a mask.

Runs on any device and is the oracle the fast backends are tested against. It loops over
the sequences of a step on the host, which is fine for a reference and for small CPU batches.
A long prefill chunk is attended in tiles of query rows, so a step's memory is bounded by
`max_score_bytes` whatever the chunk and context lengths (see `query_tile_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.kv_cache import to_kv
from nanoinfer.model.layers import softcap

# 64 MiB of fp32 scores per tile: 233 query rows of the default model (9 heads) at 8000 keys.
DEFAULT_MAX_SCORE_BYTES = 64 * 2**20


def query_tile_rows(heads: int, context_len: int, max_score_bytes: int) -> int:
    """Query rows per SDPA call such that heads x rows x keys fp32 scores (what a math-path
    SDPA materializes) fit in `max_score_bytes`; one row at least."""
    return max(1, max_score_bytes // (heads * context_len * 4))


class SeqView(NamedTuple):
    """Where one sequence's queries sit in the step, and what they may attend to."""

    query_start: int
    query_end: int
    block_ids: torch.Tensor  # [blocks covering the context] physical block ids
    context_len: int


class ReferenceMetadata(NamedTuple):
    seqs: tuple[SeqView, ...]
    scale: float
    window: int | None  # sliding window of the layers this serves; None = full causal
    softcap: float | None = None  # Gemma 2's attention soft-capping: scores -> tanh(s / c) * c before the softmax


class ReferenceAttention:
    """Stateless beyond its tile budget; one instance serves every model."""

    def __init__(self, max_score_bytes: int = DEFAULT_MAX_SCORE_BYTES):
        self.max_score_bytes = max_score_bytes

    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None) -> ReferenceMetadata:
        starts = batch.query_start_loc.tolist()
        seqs = tuple(SeqView(starts[s], starts[s + 1], batch.block_tables[s], context_len)
                     for s, context_len in enumerate(batch.seq_lens.tolist()))
        return ReferenceMetadata(seqs, cfg.softmax_scale, window, cfg.attn_softcap)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # Flat views [num_blocks * block_size, kv_heads, head_dim]: a slot is one row.
        _, num_blocks, block_size, kv_heads, head_dim = kv_layer.shape
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        kv_layer[0].view(-1, kv_heads, head_dim)[slots] = to_kv(k[valid], kv_layer.dtype)
        kv_layer[1].view(-1, kv_heads, head_dim)[slots] = to_kv(v[valid], kv_layer.dtype)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, metadata: ReferenceMetadata) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; padding rows past the last sequence stay zero.
        out = torch.zeros_like(q)
        _, _, block_size, kv_heads, head_dim = kv_layer.shape
        window = metadata.window
        for seq in metadata.seqs:
            n = seq.query_end - seq.query_start
            if n == 0:
                continue
            num_blocks = -(-seq.context_len // block_size)
            pages = seq.block_ids[:num_blocks].long()
            # k, v: [kv_heads, context, head_dim] after the gather
            # (an fp8 pool widens to the queries' dtype)
            k = kv_layer[0].index_select(0, pages).reshape(-1, kv_heads, head_dim)[: seq.context_len].transpose(0, 1)
            v = kv_layer[1].index_select(0, pages).reshape(-1, kv_heads, head_dim)[: seq.context_len].transpose(0, 1)
            k, v = k.to(q.dtype), v.to(q.dtype)
            q_seq = q[seq.query_start : seq.query_end].transpose(0, 1)  # [heads, n, head_dim]
            rows = query_tile_rows(q.shape[1], seq.context_len, self.max_score_bytes)
            for first in range(0, n, rows):
                last = min(first + rows, n)
                # Query i of the chunk sits at position context_len - n + i; it sees keys at
                # positions <= its own, and within the sliding window when the layer has one.
                # Keys no query of the tile sees are left out of the call altogether.
                first_pos, hi = seq.context_len - n + first, seq.context_len - n + last
                lo = 0 if window is None else max(0, first_pos - window + 1)
                mask = None
                if last - first > 1:
                    q_pos = torch.arange(first_pos, hi, device=q.device)
                    k_pos = torch.arange(lo, hi, device=q.device)
                    mask = k_pos[None, :] <= q_pos[:, None]
                    if window is not None:
                        mask &= k_pos[None, :] > q_pos[:, None] - window
                # A batch dimension of 1 lets torch pick its fused kernels (flash on the CPU),
                # which take a mask and GQA without materializing the scores; 3-D inputs run
                # the math path. Soft-capped scores (Gemma 2) are no SDPA's: written out.
                q_tile, k_tile, v_tile = q_seq[None, :, first:last], k[None, :, lo:hi], v[None, :, lo:hi]
                if metadata.softcap is None:
                    o = F.scaled_dot_product_attention(q_tile, k_tile, v_tile, attn_mask=mask, scale=metadata.scale,
                                                       enable_gqa=True)
                else:
                    o = capped_attention(q_tile, k_tile, v_tile, mask, metadata.scale, metadata.softcap)
                out[seq.query_start + first : seq.query_start + last] = o[0].transpose(0, 1)
        return out


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     cap: float) -> torch.Tensor:
    """SDPA's math with soft-capped scores, as transformers' eager attention computes Gemma 2's: q [1, heads, n, d],
    k and v [1, kv_heads, keys, d]; the scores times `scale`, then tanh(s / cap) * cap, then the mask and softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap((q @ k.transpose(-1, -2)).float() * scale, cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1).to(v.dtype) @ v


REFERENCE = ReferenceAttention()
