"""Logit processors that depend on a row's history: min_tokens, logit_bias, repetition,
presence and frequency penalties — dense per-row tensors, applied without a loop over rows."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from nanoinfer.host_copy import to_device

from nanoinfer.sampling_params import SamplingParams


def _scatter_counts(rows: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab] f32: how often each token id occurs in each row's list."""
    width = max((len(r) for r in rows), default=0)
    # Pad with an extra id `vocab` whose column is dropped: one scatter for all rows.
    ids = torch.tensor([list(r) + [vocab] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return to_device(counts[:, :vocab], torch.float32, device)


class Penalties(NamedTuple):
    output_counts: torch.Tensor  # [rows, vocab] f32: times generated so far
    seen: torch.Tensor  # [rows, vocab] bool: in the prompt or the output
    presence: torch.Tensor  # [rows] f32
    frequency: torch.Tensor  # [rows] f32
    repetition: torch.Tensor  # [rows] f32, 1 = off
    bias: torch.Tensor  # [rows, vocab] f32, added to the logits
    banned: torch.Tensor  # [rows, vocab] bool: EOS/stop ids of rows still short of min_tokens

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]], vocab: int, eos_token_ids: Sequence[int],
              device) -> "Penalties | None":
        """None when no row needs any of it (the common case costs nothing)."""
        if not any(p.has_penalties for p in params):
            return None
        rows = len(params)
        output_counts = _scatter_counts(outputs, vocab, device)
        needs_seen = [p.repetition_penalty != 1 for p in params]
        seen_lists = [list(pr) + list(out) if need else [] for pr, out, need in zip(prompts, outputs, needs_seen)]
        seen = _scatter_counts(seen_lists, vocab, device) > 0
        # Sparse (row, token) entries gathered on the host as the batch is built, then one
        # index_put each: the tables are dense, the work is proportional to the entries.
        bias_entries = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
        ban_entries = [(i, t) for i, (p, out) in enumerate(zip(params, outputs)) if len(out) < p.min_tokens
                       for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if t < vocab]
        bias = torch.zeros(rows, vocab)
        if bias_entries:
            r, t, b = zip(*bias_entries)
            bias.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=torch.float32))
        banned = torch.zeros(rows, vocab, dtype=torch.bool)
        if ban_entries:
            r, t = zip(*ban_entries)
            banned[torch.tensor(r), torch.tensor(t)] = True

        def col(values):
            return to_device(values, torch.float32, device)

        return cls(output_counts, seen, col([p.presence_penalty for p in params]),
                   col([p.frequency_penalty for p in params]), col([p.repetition_penalty for p in params]),
                   to_device(bias, torch.float32, device), to_device(banned, torch.bool, device))


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """In vLLM's order: min_tokens ban, logit bias, repetition (transformers' rule: divide a
    positive logit, multiply a negative one), then frequency and presence (OpenAI's rule)."""
    logits = logits.masked_fill(pen.banned, float("-inf")) + pen.bias
    r = pen.repetition[:, None]
    logits = torch.where(pen.seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - pen.frequency[:, None] * pen.output_counts - pen.presence[:, None] * (pen.output_counts > 0)
