"""Logit processors that depend on a row's history: min_tokens, logit_bias, repetition,
presence and frequency penalties — dense per-row tensors, applied without a loop over rows."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from nanoinfer.backends.host_copy import to_device

from nanoinfer.sampling.sampling_params import SamplingParams


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
        steps = to_device([len(out) for out in outputs], torch.int64, device)
        return PenaltyRows.build(params, prompts, outputs, vocab, eos_token_ids, device).gather(slice(None), steps)


class PenaltyRows(NamedTuple):
    """Rows' penalty tables, from which a step's Penalties are gathered: all of them but the
    min_tokens ban, which depends on the step. (The model runner's input batch keeps one for
    its running rows and counts each sampled token into it on the device.)"""

    output_counts: torch.Tensor  # [rows, vocab] f32: times generated so far
    seen: torch.Tensor  # [rows, vocab] bool: in the prompt or the output (rows with a repetition penalty)
    bias: torch.Tensor  # [rows, vocab] f32
    stop_mask: torch.Tensor  # [rows, vocab] bool: EOS/stop ids, banned while a row is short of min_tokens
    scalars: torch.Tensor  # [rows, 4] f32: presence, frequency, repetition, min_tokens

    @classmethod
    def neutral(cls, rows: int, vocab: int, device) -> "PenaltyRows":
        """Rows that change no logits."""
        return cls(torch.zeros(rows, vocab, device=device), torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                   torch.zeros(rows, vocab, device=device), torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                   torch.tensor([0.0, 0.0, 1.0, 0.0], device=device).repeat(rows, 1))

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]], vocab: int, eos_token_ids: Sequence[int], device) -> "PenaltyRows":
        """The rows of `params`, each with its prompt and its output so far (a row without
        penalties is a neutral one)."""
        rows = len(params)
        output_counts = _scatter_counts(outputs, vocab, device)
        needs_seen = [p.repetition_penalty != 1 for p in params]
        seen_lists = [list(pr) + list(out) if need else [] for pr, out, need in zip(prompts, outputs, needs_seen)]
        seen = _scatter_counts(seen_lists, vocab, device) > 0
        # Sparse (row, token) entries gathered on the host, then one index_put each: the
        # tables are dense, the work is proportional to the entries.
        bias_entries = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
        stop_entries = [(i, t) for i, p in enumerate(params)
                        for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if t < vocab]
        bias = torch.zeros(rows, vocab)
        if bias_entries:
            r, t, b = zip(*bias_entries)
            bias.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=torch.float32))
        stop_mask = torch.zeros(rows, vocab, dtype=torch.bool)
        if stop_entries:
            r, t = zip(*stop_entries)
            stop_mask[torch.tensor(r), torch.tensor(t)] = True
        scalars = [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens] for p in params]
        return cls(output_counts, seen, to_device(bias, torch.float32, device),
                   to_device(stop_mask, torch.bool, device), to_device(scalars, torch.float32, device).reshape(rows, 4))

    def gather(self, rows: torch.Tensor | slice, steps: torch.Tensor) -> Penalties:
        """The Penalties of `rows` (indices, or slice(None) for all), each drawing the token at
        index `steps` [rows] of its output (below min_tokens, its stop ids are banned)."""
        scalars = self.scalars[rows]
        banned = self.stop_mask[rows] & (steps < scalars[:, 3])[:, None]
        return Penalties(self.output_counts[rows], self.seen[rows], scalars[:, 0], scalars[:, 1], scalars[:, 2],
                         self.bias[rows], banned)


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """In vLLM's order: min_tokens ban, logit bias, repetition (transformers' rule: divide a
    positive logit, multiply a negative one), then frequency and presence (OpenAI's rule)."""
    logits = logits.masked_fill(pen.banned, float("-inf")) + pen.bias
    r = pen.repetition[:, None]
    logits = torch.where(pen.seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - pen.frequency[:, None] * pen.output_counts - pen.presence[:, None] * (pen.output_counts > 0)
