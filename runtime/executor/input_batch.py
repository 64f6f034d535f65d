"""InputBatch: each running sequence's per-row state, kept on the host and the device between steps.

A sequence gets a row when it starts running and keeps it until it stops. Its block table,
its sampling parameters, its last sampled token and (for penalties) its token counts live in
preallocated tensors: written when the row joins or its table grows, never rebuilt per step.
A step gathers the rows it runs. So a decode step's host work grows with what changed (a new
block here and there, a row joining), not with batch × context, and penalties need no token
history from the host: the counts are updated on the device by the sampler's own output.

The block tables have a host copy (pinned on CUDA) that the step's slot mapping is computed
from with numpy, and a device copy the attention kernels read; updates go to both, the
device's in one packed copy per step (`flush`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from nanoinfer.backends.host_copy import to_device_packed
from nanoinfer.sampling.sampler import SamplingColumns, SamplingTensors
from runtime.executor.step import Sequence

if TYPE_CHECKING:
    from nanoinfer.sampling.penalties import PenaltyRows


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 device: torch.device):
        self.device, self.vocab_size, self.eos_token_ids = device, vocab_size, eos_token_ids
        self.max_blocks = max_blocks
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(max_rows - 1, -1, -1))
        pin = device.type == "cuda"
        self.table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, pin_memory=pin)  # host
        self.table_np = self.table.numpy()
        self.table_device = self.table if device.type == "cpu" else torch.zeros_like(self.table, device=device)
        self.synced = np.zeros(max_rows, dtype=np.int64)  # entries of each row's table written so far
        self.last_token = torch.zeros(max_rows, dtype=torch.int64, device=device)  # each row's latest sample
        # Sampling parameters: host columns (flags are read there) and their device copies.
        self.columns = SamplingColumns.zeros(max_rows)
        self.floats_device = torch.zeros(self.columns.floats.shape, dtype=torch.float32, device=device)
        self.ints_device = torch.zeros(self.columns.ints.shape, dtype=torch.int64, device=device)
        self.penalties: PenaltyRows | None = None  # (made when a row first uses penalties)
        self._table_updates: list[tuple[int, int, int]] = []  # (row, column, block)
        self._joined: list[tuple[int, Sequence]] = []  # rows whose parameters still go to the device
        self._emitted: list[tuple[int, int]] = []  # (row, token) verified on the host, not yet counted

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self.row_of

    def add(self, seq: Sequence) -> int:
        """Give `seq` a row: its table, parameters and last token (sent at the next flush)."""
        row = self.row_of.get(seq.seq_id)
        if row is not None:
            return row
        if not self._free:
            raise RuntimeError("internal: more running sequences than the input batch has rows")
        row = self._free.pop()
        self.row_of[seq.seq_id] = row
        self.columns.set(row, seq.params, self.vocab_size)
        self.table_np[row, :len(seq.block_table)] = seq.block_table
        self._table_updates.extend((row, i, b) for i, b in enumerate(seq.block_table))
        self.synced[row] = len(seq.block_table)
        self._joined.append((row, seq))
        return row

    @property
    def joining(self) -> bool:
        """Rows joined since the last flush (it writes their state on the device)."""
        return bool(self._joined)

    def remove(self, seq: Sequence) -> None:
        row = self.row_of.pop(seq.seq_id, None)
        if row is not None:
            self._free.append(row)
            self._joined = [(r, s) for r, s in self._joined if r != row]

    def sync_table(self, seq: Sequence, first: int) -> None:
        """Copy `seq`'s block table into its row from entry `first` on (blocks replaced by
        copy-on-write: only ever in the range a step is about to write), and every entry not
        written yet (new blocks; a fork's shared prompt blocks)."""
        row = self.row_of[seq.seq_id]
        table = seq.block_table
        for i in range(min(first, int(self.synced[row])), len(table)):
            if self.table_np[row, i] != table[i]:
                self.table_np[row, i] = table[i]
                self._table_updates.append((row, i, table[i]))
        self.synced[row] = len(table)

    def flush(self) -> None:
        """Send what changed since the last flush to the device: table entries, and the
        parameters (and penalty rows) of rows that joined."""
        joined, self._joined = self._joined, []
        updates, self._table_updates = self._table_updates, []
        emitted, self._emitted = self._emitted, []
        if emitted and self.penalties is not None:
            rows, tokens = to_device_packed(list(zip(*emitted)), torch.int64, self.device)
            self.sampled_at(rows, tokens)
        if self.device.type != "cpu" and updates:
            rows, cols, blocks = to_device_packed(list(zip(*updates)), torch.int64, self.device)
            self.table_device[rows, cols] = blocks.to(torch.int32)
        if not joined:
            return
        rows = [r for r, _ in joined]
        rows_t, tokens, ints = to_device_packed(
            [rows, [s.token_ids[-1] for _, s in joined], self.columns.ints[:, rows]], torch.int64, self.device)
        (floats,) = to_device_packed([self.columns.floats[:, rows]], torch.float32, self.device)
        self.floats_device[:, rows_t] = floats
        self.ints_device[:, rows_t] = ints
        self.last_token[rows_t] = tokens  # (a row's first step after a swap-in decodes this token)
        if any(s.params.has_penalties for _, s in joined) or self.penalties is not None:
            self._init_penalties(rows_t, [s for _, s in joined])

    def _init_penalties(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """Fill the joined rows' penalty tables (neutral for the rows that use no penalties)."""
        from nanoinfer.sampling.penalties import (
            PenaltyRows,  # (the first row that uses penalties brings them)
        )

        if self.penalties is None:
            self.penalties = PenaltyRows.neutral(self.table.shape[0], self.vocab_size, self.device)
        fresh = PenaltyRows.build([s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                                  [s.output_token_ids for s in seqs], self.vocab_size, self.eos_token_ids, self.device)
        for table, values in zip(self.penalties, fresh):
            table[rows] = values

    def sampling(self, rows: np.ndarray, rows_device: torch.Tensor, steps: torch.Tensor) -> SamplingTensors:
        """The sampling tensors of the rows a step samples (in that order); `steps` [rows]:
        how many tokens each has produced (the index of the one being drawn)."""
        flags = self.columns.flags
        penalties = None
        if self.penalties is not None and flags[SamplingColumns.PENALIZED][rows].any():
            penalties = self.penalties.gather(rows_device, steps)
        return SamplingTensors.of_columns(self.floats_device[:, rows_device], self.ints_device[:, rows_device], steps,
                                          flags, rows, penalties)

    def sampled(self, rows_device: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record a step's samples on the device: each row's last token, and its counts."""
        self.last_token[rows_device] = tokens
        if self.penalties is not None:
            self.sampled_at(rows_device, tokens)

    def sampled_at(self, rows_device: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count generated tokens in their rows' penalty tables (a row may repeat)."""
        self.penalties.output_counts.index_put_((rows_device, tokens), torch.ones_like(tokens, dtype=torch.float32),
                                                accumulate=True)
        self.penalties.seen[rows_device, tokens] = True

    def emitted(self, seq: Sequence, token_ids: list[int]) -> None:
        """Tokens verification emitted for `seq` (known on the host): counted at the next flush.
        Verification leaves each row's `last_token` alone: its step is resolved before the
        next one is planned, so the next step reads the tokens from the host."""
        row = self.row_of.get(seq.seq_id)
        if row is not None and self.penalties is not None:
            self._emitted += ((row, t) for t in token_ids)
