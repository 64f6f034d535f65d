"""Batch: the index tensors of one forward step, and how to build them from sequence chunks."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from nanoinfer.backends.host_copy import to_device_packed

# Batch's and HostBatch's sizes (NamedTuples take no base class to share them from).
_NUM_TOKENS = property(lambda self: self.input_ids.shape[0], doc="Query rows (tokens) of the step.")
_NUM_SEQS = property(lambda self: self.seq_lens.shape[0], doc="Sequences of the step.")


class Batch(NamedTuple):
    """One step's work: the new tokens of every scheduled sequence, flattened.

    Prefill chunks and decodes mix freely: sequence s owns the query rows
    query_start_loc[s]:query_start_loc[s+1]; its context after this step is seq_lens[s]
    tokens, the last of them being its new ones.
    """

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] int64, flat KV slot (block * block_size + offset); -1 = padding
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, physical block ids; unused entries 0
    seq_lens: torch.Tensor  # [seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [seqs + 1] int32, cu_seqlens of the queries
    logits_indices: torch.Tensor  # [samples] int64, the token rows whose logits are computed

    num_tokens = _NUM_TOKENS
    num_seqs = _NUM_SEQS


class HostBatch(NamedTuple):
    """A Batch's arrays on the host (numpy; the same fields, the same dtypes as on the device),
    before they move: a CUDA graph takes them in one copy (nanoinfer/backends/cuda/graphs.py)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray

    num_tokens = _NUM_TOKENS
    num_seqs = _NUM_SEQS

    def to(self, device: torch.device | str) -> Batch:
        """On `device`, in two copies: the int64 columns, and the int32 ones (see
        host_copy.to_device_packed)."""
        input_ids, positions, slot_mapping, logits_indices = to_device_packed(
            [self.input_ids, self.positions, self.slot_mapping, self.logits_indices], torch.int64, device)
        block_tables, seq_lens, query_start_loc = to_device_packed(
            [self.block_tables, self.seq_lens, self.query_start_loc], torch.int32, device)
        return Batch(input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc, logits_indices)


class SeqChunk(NamedTuple):
    """The part of one sequence that a step computes: `token_ids` at positions
    `start_pos`.., its `block_table` covering at least start_pos + len(token_ids) tokens, and
    whether this chunk ends at a token whose logits are wanted."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    compute_logits: bool


def build_batch(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu",
                logits_rows: Sequence[int] | None = None) -> Batch:
    """Lay out the chunks as one Batch on `device` (see `host_batch`)."""
    return host_batch(chunks, block_size, logits_rows).to(device)


def host_batch(chunks: Sequence[SeqChunk], block_size: int, logits_rows: Sequence[int] | None = None) -> HostBatch:
    """Lay out the chunks as one batch, on the host. `logits_rows` overrides the rows whose
    logits are computed (default: the last row of each chunk that asks for them). The block
    tables keep the chunks' own width (a graph is chosen by it: nanoinfer/backends/cuda/graphs.py)."""
    num = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=num)
    starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=num)
    widths = np.fromiter((len(c.block_table) for c in chunks), dtype=np.int64, count=num)
    too_small = np.nonzero(widths * block_size < starts + lens)[0]
    if too_small.size:
        c = chunks[too_small[0]]
        raise ValueError(f"block table of {len(c.block_table)} blocks cannot hold {c.start_pos + len(c.token_ids)} "
                         f"tokens at block size {block_size}")
    block_tables = np.zeros((num, int(widths.max()) if num else 0), dtype=np.int32)
    for i, c in enumerate(chunks):
        block_tables[i, : len(c.block_table)] = c.block_table
    at = layout(starts, lens, block_tables, None, block_size)
    input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=at.positions.shape[0])
    wants = np.fromiter((c.compute_logits for c in chunks), dtype=bool, count=num)
    logits_indices = (at.query_start_loc[1:][wants].astype(np.int64) - 1 if logits_rows is None
                      else np.asarray(logits_rows, dtype=np.int64).reshape(-1))
    return HostBatch(input_ids, at.positions, at.slot_mapping, block_tables, at.seq_lens, at.query_start_loc,
                     logits_indices)


class Layout(NamedTuple):
    """Where a step's tokens go: the index arrays of a Batch but its tokens and logits rows,
    and which sequence each token belongs to."""

    query_start_loc: np.ndarray  # [seqs + 1] int32
    seq_of_token: np.ndarray  # [tokens] int64: the sequence (chunk) index of each token
    positions: np.ndarray  # [tokens] int64
    slot_mapping: np.ndarray  # [tokens] int64
    seq_lens: np.ndarray  # [seqs] int32
    num_blocks: int  # block-table entries the longest context spans (the table width it needs)


def layout(starts: np.ndarray, lens: np.ndarray, tables: np.ndarray, rows: np.ndarray | None,
           block_size: int) -> Layout:
    """The layout of chunks of `lens` [seqs] tokens from positions `starts` [seqs] (int64), the
    block table of chunk i being `tables[rows[i]]` (`tables[i]` when `rows` is None).

    The one place a step's index arrays are computed (host_batch from SeqChunks, and the model
    runner from its input batch's rows), with numpy and no loop over tokens: a step at batch 256
    has ~32k block-table entries, and Python lists of them cost milliseconds.
    """
    num = starts.shape[0]
    query_start_loc = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    ends = starts + lens
    # Per token: its sequence, and its position = the chunk's start + its offset in the chunk.
    seq_of_token = np.repeat(np.arange(num), lens)
    positions = np.arange(total) + (starts - query_start_loc[:-1])[seq_of_token]
    table_rows = seq_of_token if rows is None else rows[seq_of_token]
    slots = tables[table_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    num_blocks = int(-(-ends.max() // block_size)) if num else 0
    return Layout(query_start_loc.astype(np.int32), seq_of_token, positions, slots, ends.astype(np.int32), num_blocks)
