"""A sampled row's draw: the distribution it draws from (temperature, top-k, top-p, min-p) and
the exponential race over counter-based noise. nanoinfer.sampling.sampler.sample imports it for the
first step with a sampled row; a greedy request never loads it.

Randomness comes from a counter-based hash of (seed, step, token id) rather than a
torch.Generator: a request's draws then depend only on its own seed and how many tokens it has
produced, never on which other requests share the batch, and no per-row generator state has
to live anywhere.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RowSettings(Protocol):
    """What a draw reads of a step's rows (the sampler's SamplingTensors has these fields)."""

    temperature: torch.Tensor  # [rows] f32
    top_k: torch.Tensor  # [rows] i64
    top_p: torch.Tensor  # [rows] f32
    min_p: torch.Tensor  # [rows] f32
    needs_sort: bool  # some row uses top-k or top-p
    needs_min_p: bool


def processed_probs(logits: torch.Tensor, st: RowSettings) -> torch.Tensor:
    """The distribution a sampled row draws from [rows, vocab] (fp32 logits, penalties already
    applied): temperature, top-k, top-p, then min-p relative to the most likely token. Masked
    tokens have probability 0; the rows are not renormalized after min-p (a draw needs no sum)."""
    scaled = logits / st.temperature.clamp_min(1e-6)[:, None]
    if st.needs_sort:
        scaled = apply_top_k_top_p(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(dim=-1)
    if st.needs_min_p:
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside the smallest set whose
    probability (renormalized after top-k) reaches top-p. The most likely token always stays,
    and a top-p of 1 masks nothing (the fp32 cumsum can reach 1 before the last token)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


_MASK32 = 0xFFFF_FFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in 16-bit halves so int64 never overflows."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (the 'lowbias32' constants): a bijection whose output bits
    each depend on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] f32 uniforms in (0, 1), a pure function of (seed, step, token id)."""
    key = _mix32(_mix32(seeds & _MASK32) ^ (seeds >> 32))
    key = _mix32((key + _mul32(steps & _MASK32, 0x9E3779B9)) & _MASK32)  # [rows]
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32((key[:, None] ^ _mix32(token)[None, :]))
    return uniform_noise_from_bits(_mix32((bits + key[:, None]) & _MASK32))


def uniform_noise_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """f32 uniforms from 32-bit hash values (int64 in [0, 2**32))."""
    # The top 23 bits, centred in their bucket: (2k + 1) / 2**24, exact in float32, in
    # [2**-24, 1 - 2**-24]. With 24 bits the top centre, 1 - 2**-25, falls halfway between
    # two floats and rounds to 1.0: E = -log(1) = 0 then wins the race for a masked token.
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def exponential_race(probs: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) per row: with E ~ Exp(1) this draws token i with probability p_i (the
    Gumbel-max trick without the normalization or a host sync). A token of probability 0 (one
    that top-k, top-p, min-p or a ban masked) never wins, whatever E holds: 0/0 would be NaN,
    and argmax takes NaN for the largest value."""
    return torch.where(probs > 0, probs / exponential, -1.0).argmax(dim=-1)


def random_draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn with probability `probs` [rows, vocab]: the exponential race
    over the counter-based noise of each row's (seed, step). Eager, it makes ~40 passes over
    [rows, vocab] int64 tensors (the hash); on CUDA nanoinfer.backends.cuda.draw_triton draws the same tokens
    in one pass, the noise computed in registers, and on the CPU so does cpu_native's
    `random_draw` for a packed model (a log only for the tokens that could still win). This
    stays their oracle."""
    return exponential_race(probs, -torch.log(uniform_noise(seeds, steps, probs.shape[-1])))
