"""Batch: the index tensors of one forward step, and how to build them from sequence chunks."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class SeqChunk(NamedTuple):
    """The part of one sequence that a step computes: `token_ids` at positions
    `start_pos`.., its `block_table` covering at least start_pos + len(token_ids) tokens, and
    whether this chunk ends at a token whose logits are wanted."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    compute_logits: bool


def build_batch(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu") -> Batch:
    """Lay out the chunks as one Batch on `device`. Built on the host in plain Python lists
    and moved in one copy per tensor."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    max_blocks = max((len(c.block_table) for c in chunks), default=0)
    block_tables = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        end = chunk.start_pos + n
        if len(chunk.block_table) * block_size < end:
            raise ValueError(
                f"block table of {len(chunk.block_table)} blocks cannot hold {end} tokens at block size {block_size}"
            )
        input_ids.extend(chunk.token_ids)
        for pos in range(chunk.start_pos, end):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + n)
        if chunk.compute_logits:
            logits_indices.append(query_start_loc[-1] - 1)
        block_tables.append(list(chunk.block_table) + [0] * (max_blocks - len(chunk.block_table)))

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return Batch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        block_tables=tensor(block_tables, torch.int32).reshape(len(chunks), max_blocks),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start_loc=tensor(query_start_loc, torch.int32),
        logits_indices=tensor(logits_indices, torch.int64),
    )
