"""Speculative decoding's verification: which draft tokens the target accepts, and the token after them.

A step verifies a sequence's j draft tokens d_1..d_j with j + 1 rows of target logits: row i
holds p_i, the target's distribution for the position of d_{i+1} (row j: the position after
the last draft). Draft d_{i+1} is accepted with probability min(1, p_i(d)/q_i(d)), q being the
distribution the draft was drawn from (a point mass for a deterministic proposal such as
n-gram lookup). The first rejected row draws its token from the residual max(0, p_i - q_i),
renormalized; a sequence whose drafts all pass draws a bonus token from p_j. Every emitted
token then follows the target's distribution exactly (Leviathan et al. 2023, Chen et al.
2023). Greedy rows accept a draft iff it is the target's argmax, and emit the argmax: token for
token what decoding without speculation emits.

Randomness is the sampler's counter-based hash (nanoinfer/sampling/sampler.py), so seeded requests
reproduce: the residual and bonus draws use the stream of the token's own step (a bonus draw
is the very token a step without speculation would have drawn), the acceptance tests and the
draft model's draws use streams of salted seeds, independent of it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from nanoinfer.sampling.draw import processed_probs, random_draw, uniform_noise
from nanoinfer.sampling.sampler import SamplingTensors, greedy_tokens

ACCEPT_SALT = 0x5BD1_E995  # xor'd into a row's seed: the acceptance tests' stream
DRAFT_SALT = 0x27D4_EB2F  # the draft model's draws


class Verified(NamedTuple):
    """Per verification row."""

    accepted: torch.Tensor  # [rows] bool: the row's draft passed (False on a sequence's last row)
    tokens: torch.Tensor  # [rows] int64: the draft where accepted, else the row's own draw


def target_distribution(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """p [rows, vocab], summing to 1: what the sampler draws from (penalties applied already)."""
    probs = processed_probs(logits, st)
    return probs / probs.sum(dim=-1, keepdim=True) if st.needs_min_p else probs


def verify(logits: torch.Tensor, st: SamplingTensors, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor | None = None, draw: Callable | None = None) -> Verified:
    """Verify drafts row by row. `logits` [rows, vocab] fp32: the target's raw logits (`st`'s
    penalties are applied here; its `steps` hold each row's token index); `draft_tokens`
    [rows] int64, -1 on each sequence's last row; `draft_probs` [rows, vocab]: the distribution
    each draft was drawn from (None: deterministic proposals). A sequence emits its accepted
    leading drafts and then the token of its first row not accepted. `draw`: as `sample`'s."""
    if st.penalties is not None:  # (penalties.py is imported by a batch that uses them, as in `sample`)
        from nanoinfer.sampling.penalties import apply_penalties

        logits = apply_penalties(logits, st.penalties)
    greedy = greedy_tokens(logits)
    has_draft = draft_tokens >= 0
    d = draft_tokens.clamp_min(0)
    accepted = has_draft & (d == greedy)
    if st.all_greedy:
        return Verified(accepted, torch.where(accepted, d, greedy))
    p = target_distribution(logits, st)
    p_d = p.gather(1, d[:, None])[:, 0]
    if draft_probs is None:  # a point mass: accept with p(d); the residual is p without d
        q_d = torch.ones_like(p_d)
        residual = p.scatter(1, d[:, None], torch.where(has_draft, 0.0, p_d)[:, None])
    else:
        q_d = draft_probs.gather(1, d[:, None])[:, 0]
        residual = torch.where(has_draft[:, None], (p - draft_probs).clamp_min(0.0), p)
    u = uniform_noise(st.seeds ^ ACCEPT_SALT, st.steps, 1)[:, 0]
    sampled = st.temperature > 0
    accepted = torch.where(sampled, has_draft & (u * q_d < p_d), accepted)
    # (An exponential race needs no normalized weights: the residual is drawn as it is.)
    own = torch.where(sampled, (draw or random_draw)(residual, st.seeds, st.steps), greedy)
    return Verified(accepted, torch.where(accepted, d, own))


def draft_sample(logits: torch.Tensor, st: SamplingTensors,
                 draw: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft model's proposal per row (`logits` in the model's dtype: a greedy draft needs
    no fp32 copy of them) and the distribution q it was drawn from (None when
    every row is greedy: the argmax, which verification compares with the target's). The
    draft uses the request's temperature, top-k, top-p and min-p but no penalties: any q
    keeps the output exact, as long as the draft really is drawn from it."""
    greedy = greedy_tokens(logits)  # (in the logits' own dtype: widening is exact, so the argmax is the same)
    if st.all_greedy:
        return greedy, None
    q = target_distribution(logits.float(), st)
    return torch.where(st.temperature > 0, (draw or random_draw)(q, st.seeds ^ DRAFT_SALT, st.steps), greedy), q


def draft_history(num_drafts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(verification row, draft index) pairs: the drafts whose counts a row's penalties must
    add (row i of a sequence follows its drafts 1..i, tokens generated before it). Rows are
    laid out `num_drafts[s] + 1` per sequence, drafts `num_drafts[s]` per sequence."""
    rows, drafts, row, first = [], [], 0, 0
    for j in num_drafts:
        for i in range(1, j + 1):
            rows += [row + i] * i
            drafts += range(first, first + i)
        row += j + 1
        first += j
    return np.array(rows, dtype=np.int64), np.array(drafts, dtype=np.int64)
