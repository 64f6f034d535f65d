"""SamplingParams (vLLM's names) and the vectorized sampler: per-row tensors, no host sync.

Every row carries its own temperature, top-k, top-p, min-p and seed as tensors, so one batch
mixes greedy and sampled requests without a Python loop over rows. A greedy row takes the
argmax here; a sampled row's distribution and random draw are nanoinfer/sampling/draw.py's, imported by
the first step with a sampled row (a greedy request never loads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import torch

from nanoinfer.backends.host_copy import to_device_packed
from nanoinfer.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:  # (nanoinfer/sampling/penalties.py is imported only by a batch with a row that uses them)
    from nanoinfer.sampling.penalties import Penalties

__all__ = ["SamplingParams", "SamplingColumns", "SamplingTensors", "Logprobs", "compute_logprobs", "sample",
           "greedy_and_finite", "greedy_tokens"]


class SamplingColumns(NamedTuple):
    """Rows' sampling parameters as host columns: the layout SamplingTensors is cut from (each
    matrix moves to the device in one copy), and per-row flags that let a step skip work."""

    floats: np.ndarray  # [3, rows] f32: temperature, top_p, min_p
    ints: np.ndarray  # [2, rows] i64: top_k (the vocabulary size when off), seed (its low 48 bits)
    flags: np.ndarray  # [4, rows] bool: greedy, sorts (top-k or top-p), min-p, penalized (see SamplingParams)

    GREEDY, SORTS, MIN_P, PENALIZED = range(4)  # (the rows of `flags`)

    @classmethod
    def zeros(cls, rows: int) -> "SamplingColumns":
        return cls(np.zeros((3, rows), dtype=np.float32), np.zeros((2, rows), dtype=np.int64),
                   np.zeros((4, rows), dtype=bool))

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> "SamplingColumns":
        columns = cls.zeros(len(params))
        for row, p in enumerate(params):
            columns.set(row, p, vocab_size)
        return columns

    def set(self, row: int, p: SamplingParams, vocab_size: int) -> None:
        """Row `row` takes the parameters `p`."""
        top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
        self.floats[:, row] = (p.temperature, p.top_p, p.min_p)
        self.ints[:, row] = (top_k, (p.seed or 0) & 0xFFFF_FFFF_FFFF)
        self.flags[:, row] = (p.greedy, not p.greedy and (top_k < vocab_size or p.top_p < 1),
                              not p.greedy and p.min_p > 0, p.has_penalties)


class SamplingTensors(NamedTuple):
    """The sampling parameters of a step's rows, as tensors on the logits' device, plus host
    flags that let a step skip work no row needs (known when the batch is built: no sync)."""

    temperature: torch.Tensor  # [rows] f32, 0 = greedy
    top_k: torch.Tensor  # [rows] i64, vocab size when disabled
    top_p: torch.Tensor  # [rows] f32
    min_p: torch.Tensor  # [rows] f32
    seeds: torch.Tensor  # [rows] i64
    steps: torch.Tensor  # [rows] i64, index of the token being drawn within its request
    all_greedy: bool
    needs_sort: bool  # some row uses top-k or top-p
    needs_min_p: bool
    penalties: Penalties | None = None  # history-dependent processors, when a row uses any
    any_greedy: bool = True  # some row takes the argmax (False: a step of sampled rows needs none)

    @classmethod
    def of_columns(cls, floats: torch.Tensor, ints: torch.Tensor, steps: torch.Tensor, flags: np.ndarray,
                   rows: np.ndarray | slice = slice(None), penalties: Penalties | None = None) -> "SamplingTensors":
        """From a SamplingColumns' matrices of the rows on the device (`floats`, `ints`) and,
        on the host, the `rows` of its `flags`. (The one constructor: `build`, and the model
        runner's input batch, which keeps every running row's columns on the device, end here.)"""
        c = SamplingColumns  # (each flag gathered on its own: faster than a gather of the [4, rows] matrix)
        return cls(floats[0], ints[0], floats[1], floats[2], ints[1], steps,
                   all_greedy=bool(flags[c.GREEDY][rows].all()), needs_sort=bool(flags[c.SORTS][rows].any()),
                   needs_min_p=bool(flags[c.MIN_P][rows].any()), penalties=penalties,
                   any_greedy=bool(flags[c.GREEDY][rows].any()))

    @classmethod
    def build(cls, params: Sequence[SamplingParams], steps: Sequence[int], vocab_size: int,
              device: torch.device | str, *, prompts: Sequence[Sequence[int]] = (),
              outputs: Sequence[Sequence[int]] = (), eos_token_ids: Sequence[int] = ()) -> "SamplingTensors":
        """`prompts` and `outputs` (each row's token history) are needed only by rows with
        penalties, logit bias or min_tokens."""
        columns = SamplingColumns.of(params, vocab_size)
        (floats,) = to_device_packed([columns.floats], torch.float32, device)
        ints, steps_t = to_device_packed([columns.ints, list(steps)], torch.int64, device)
        penalties = None
        if any(p.has_penalties for p in params):
            from nanoinfer.sampling.penalties import Penalties

            penalties = Penalties.build(params, prompts or [()] * len(params), outputs or [()] * len(params),
                                        vocab_size, eos_token_ids, device)
        return cls.of_columns(floats, ints, steps_t, columns.flags, penalties=penalties)


def greedy_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [rows, vocab] (any float dtype): the most likely token (int64; the
    first on ties, as on the fp32 copy: widening is exact) and whether every logit is
    finite. Two reading passes, no float copy: what a greedy step needs from its logits."""
    if logits.is_cuda:  # (one pass, split over the vocabulary: nanoinfer/backends/cuda/argmax.py)
        from nanoinfer.backends.cuda import argmax

        return argmax.greedy_and_finite(logits)
    # (NaN propagates into both. amin and amax apart: torch's aminmax over a row is
    # unvectorized on the CPU, 113 µs against 2 x 9 at the default model's vocabulary.)
    return logits.argmax(dim=-1), logits.amin(dim=-1).isfinite() & logits.amax(dim=-1).isfinite()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row of logits [rows, vocab] (the first on ties)."""
    return greedy_and_finite(logits)[0] if logits.is_cuda else logits.argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors, draw: Callable | None = None,
           greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids [rows] (int64) from logits [rows, vocab] (fp32).

    Order per row: penalties (see `apply_penalties`), then greedy rows take the argmax and
    sampled rows draw from `nanoinfer.sampling.draw.processed_probs` (temperature, top-k, top-p, min-p)
    with `draw` (None: `nanoinfer.sampling.draw.random_draw`, eager; kernels may pass a compiled one).
    `greedy`: the logits' argmax where the caller has it already (penalties, which change it,
    make it recomputed). A step without a greedy row computes no argmax (on a GPU's host its
    launch took ~0.2 ms of a masked step's sampling).
    """
    if st.penalties is not None:
        from nanoinfer.sampling.penalties import apply_penalties

        logits = apply_penalties(logits, st.penalties)
        greedy = None
    if st.all_greedy:
        return greedy if greedy is not None else greedy_tokens(logits)
    # (A sampled row's code: a step of greedy rows never loads it.)
    from nanoinfer.sampling.draw import processed_probs, random_draw

    sampled = (draw or random_draw)(processed_probs(logits, st), st.seeds, st.steps)
    if not st.any_greedy:
        return sampled
    return torch.where(st.temperature == 0, greedy if greedy is not None else greedy_tokens(logits), sampled)


class Logprobs(NamedTuple):
    """Log-probabilities under the model's raw distribution (before penalties and
    temperature, as vLLM reports them by default)."""

    token_logprobs: torch.Tensor  # [rows] of the chosen tokens
    top_ids: torch.Tensor  # [rows, k] the k most likely tokens, best first
    top_logprobs: torch.Tensor  # [rows, k]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, max_bytes: int = 64 << 20) -> Logprobs:
    """Logprobs of `token_ids` [rows] and the top `k` under `logits` [rows, vocab], computed
    `max_bytes` of log-softmax at a time: prompt logprobs ask for a row per prompt token, and
    a whole 4,096-token chunk at a 152k vocabulary would be another 2.5 GB at once."""
    rows = max(1, max_bytes // (4 * logits.shape[-1]))
    if logits.shape[0] > rows:
        parts = [compute_logprobs(logits[i:i + rows], token_ids[i:i + rows], k, max_bytes)
                 for i in range(0, logits.shape[0], rows)]
        return Logprobs(*(torch.cat(columns) for columns in zip(*parts)))
    logp = logits.float().log_softmax(dim=-1)
    top_ids = _top_ids(logp, k) if k > 0 else logp.new_empty(logp.shape[0], 0, dtype=torch.long)
    return Logprobs(logp.gather(1, token_ids[:, None])[:, 0], top_ids, logp.gather(1, top_ids))


def _top_ids(logp: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` most likely tokens of each row of `logp` [rows, vocab] fp32, best first, equal values by the lowest
    token id (the argmax's rule). torch.topk orders equal values as its algorithm meets them, which follows the
    batch's shape on CUDA (one block or several per row), and bf16 logits tie often: here each value and its id
    make one int64 key, all distinct — the float's order as an integer (a negative float's magnitude bits
    reversed), then the id reversed."""
    bits = logp.view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))
    ids = torch.arange(logp.shape[-1], device=logp.device)
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - ids)
    return (1 << 32) - 1 - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)
