"""Structured output's masks for a step: each constrained row's allowed tokens, filled on the host.

The runner (runtime/executor/model_runner.py) asks for them while the device runs the step's
forward, and applies them to the logits before sampling (or verification). Only a step with a
constrained sequence comes here.
"""

from __future__ import annotations

import torch

from nanoinfer.host_copy import to_device_packed
from nanoinfer.structured import allocate_bitmask


def offsets(counts) -> list[int]:
    """Where each of consecutive runs of `counts` items starts."""
    result, at = [], 0
    for n in counts:
        result.append(at)
        at += n
    return result


def grammar_masks(runner, rows: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The bitmask rows of the constrained sequences among `rows` (sequence, first logits row,
    drafts it verifies) and the logits rows they mask, on the device; None if no sequence is
    constrained. (A finished sequence's rows are dropped when the step resolves: its grammar
    is not asked.)"""
    constrained = [(seq, first, drafts) for seq, first, drafts in rows
                   if seq.constraint is not None and not seq.is_finished]
    if not constrained:
        return None
    at = [first + i for _, first, drafts in constrained for i in range(len(drafts) + 1)]
    bitmask = allocate_bitmask(len(at), runner.cfg.vocab_size)
    runner.grammars.fill([(seq.constraint, row, drafts) for (seq, _, drafts), row in
                          zip(constrained, offsets(len(drafts) + 1 for _, _, drafts in constrained))], bitmask)
    (at_t,) = to_device_packed([at], torch.int64, runner.device)
    return bitmask.to(runner.device, non_blocking=True), at_t
