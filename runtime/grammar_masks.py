"""GrammarMasks: a step's structured-output masks — filled ahead on a thread, assembled for the
step's rows, sent to the device.

A mask over a large vocabulary can take llguidance a fraction of a millisecond per sequence
(inside a length-bounded JSON string, say), so at batch 64 the masks are milliseconds of host
time a step. They depend only on the tokens each grammar has consumed, which are all known
once the step before is resolved: EngineCore then `start`s filling them on a thread
(llguidance's fill releases the GIL), and they overlap the step's planning, its batch and the
launch of its forward. The runner `wait`s for them after the forward is queued and `build`s
the step's bitmask: rows filled ahead are copied, the rest (a sequence admitted or forked in
this step, verification rows after drafts) filled then.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from nanoinfer.host_copy import to_device_packed
from nanoinfer.structured import Grammars, allocate_bitmask
from runtime.sequence import Sequence


class Ahead(NamedTuple):
    """Masks filled ahead: row `rows[seq_id]` of `bitmask` is that sequence's next mask."""

    rows: dict[int, int]
    bitmask: torch.Tensor


class GrammarMasks:
    def __init__(self, grammars: Grammars, vocab_size: int, device: torch.device):
        self.grammars, self.vocab_size, self.device = grammars, vocab_size, device
        self._pool: ThreadPoolExecutor | None = None  # one thread, made on first use
        self._ahead: tuple[Future, Ahead] | None = None

    def start(self, seqs: list[Sequence]) -> None:
        """Begin filling the next masks of `seqs` (constrained, every token resolved) on the
        thread. Until `wait` (or `discard`) returns, nothing else may touch their grammars."""
        self.discard()
        if not seqs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-masks")
        ahead = Ahead({seq.seq_id: i for i, seq in enumerate(seqs)}, allocate_bitmask(len(seqs), self.vocab_size))
        future = self._pool.submit(self.grammars.fill, [(seq.constraint, i, ()) for i, seq in enumerate(seqs)],
                                   ahead.bitmask)
        self._ahead = (future, ahead)

    def wait(self) -> Ahead | None:
        """The masks filled ahead, once done (None if none were started); an error of the fill
        raises here."""
        if self._ahead is None:
            return None
        (future, ahead), self._ahead = self._ahead, None
        future.result()
        return ahead

    def discard(self) -> None:
        """Wait for masks filled ahead that no step will use (its launch failed, or there was
        nothing to launch), whatever became of them: their grammars are free again."""
        if self._ahead is not None:
            (future, _), self._ahead = self._ahead, None
            future.exception()

    def build(self, rows: list[tuple[Sequence, int, list[int]]], ahead: Ahead | None = None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bitmask rows of the constrained sequences among `rows` (sequence, first logits
        row, drafts it verifies) and the logits rows they mask, on the device; None if no
        sequence is constrained. (A finished sequence's rows are dropped when the step
        resolves: its grammar is not asked.)"""
        constrained = [(seq, first, drafts) for seq, first, drafts in rows
                       if seq.constraint is not None and not seq.is_finished]
        if not constrained:
            return None
        at = [first + i for _, first, drafts in constrained for i in range(len(drafts) + 1)]
        bitmask = allocate_bitmask(len(at), self.vocab_size)
        copied, filled, missing, row = [], [], [], 0
        for seq, _, drafts in constrained:
            early = None if drafts or ahead is None else ahead.rows.get(seq.seq_id)
            if early is None:
                missing.append((seq.constraint, row, drafts))
            else:
                copied.append(row)
                filled.append(early)
            row += len(drafts) + 1
        if copied:
            bitmask[copied] = ahead.bitmask[filled]
        if missing:
            self.grammars.fill(missing, bitmask)
        (at_t,) = to_device_packed([at], torch.int64, self.device)
        return bitmask.to(self.device, non_blocking=True), at_t
