"""Structured output's masks for a step: each constrained row's allowed tokens, filled on the host.

The runner (runtime/executor/model_runner.py) asks for them once the step's forward is queued,
and applies them to the logits before sampling (or verification). Filled now (`later=False`:
the runner queues the sampling at once), or on a thread of their own (`later=True`): the
runner then leaves the step's sampling to be queued by the next launch, so that the host plans
and builds that step while llguidance fills these masks (`PendingSampling`, runtime/executor/
step.py). Only a step with a constrained sequence comes here.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, NamedTuple

import torch

from nanoinfer.backends.host_copy import to_device_packed
from nanoinfer.structured.bitmasks import allocate_bitmask, apply_bitmask


def offsets(counts) -> list[int]:
    """Where each of consecutive runs of `counts` items starts."""
    result, at = [], 0
    for n in counts:
        result.append(at)
        at += n
    return result


class StepMasks(NamedTuple):
    """A step's grammar masks on the host: `bitmask` row i masks logits row `at[i]`."""

    bitmask: torch.Tensor  # [len(at), words] int32, pinned where CUDA is
    at: list[int]
    filling: Future | None  # done once every row is filled (None: filled already)

    def on_device(self, device: torch.device,
                  logits_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bitmask and the logits rows it masks, on `device` (waiting for the fill first);
        None for the rows where they are all `logits_rows` rows in order (a decode step whose
        every sequence is constrained: no copy)."""
        if self.filling is not None:
            self.filling.result()
        bitmask = self.bitmask.to(device, non_blocking=True)
        if logits_rows == len(self.at) and self.at == list(range(logits_rows)):
            return bitmask, None
        (at_t,) = to_device_packed([self.at], torch.int64, device)
        return bitmask, at_t

    def applied(self, logits: torch.Tensor, device: torch.device, fused: Callable | None = None) -> torch.Tensor:
        """A float32 copy of `logits` [rows, vocab] with these masks applied: by `fused` (the
        kernels' mask: nanoinfer/backends/choose.py) or nanoinfer.structured.bitmasks.apply_bitmask."""
        return (fused or apply_bitmask)(logits, *self.on_device(device, logits.shape[0]))


def grammar_masks(runner, rows: list, later: bool = False) -> StepMasks | None:
    """The bitmask rows of the constrained sequences among `rows` (sequence, first logits row,
    drafts it verifies), filled now or, with `later`, on the grammars' own thread; None if no
    sequence is constrained. (A finished sequence's rows are dropped when the step resolves:
    its grammar is not asked.)"""
    constrained = [(seq, first, drafts) for seq, first, drafts in rows
                   if seq.constraint is not None and not seq.is_finished]
    if not constrained:
        return None
    at = [first + i for _, first, drafts in constrained for i in range(len(drafts) + 1)]
    # (a draft the grammar rejects leaves the rows after it unfilled: those must allow every token)
    bitmask = allocate_bitmask(len(at), runner.cfg.vocab_size, every_token=any(drafts for _, _, drafts in constrained))
    items = [(seq.constraint, row, drafts) for (seq, _, drafts), row in
             zip(constrained, offsets(len(drafts) + 1 for _, _, drafts in constrained))]
    if later:
        return StepMasks(bitmask, at, runner.grammars.fill_later(items, bitmask))
    runner.grammars.fill(items, bitmask)
    return StepMasks(bitmask, at, None)
