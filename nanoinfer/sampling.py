"""SamplingParams (vLLM's names) and the vectorized sampler: per-row tensors, no host sync.

Every row carries its own temperature, top-k, top-p, min-p and seed as tensors, so one batch
mixes greedy and sampled requests without a Python loop over rows. Randomness comes from a
counter-based hash of (seed, step, token id) rather than a torch.Generator: a request's draws
then depend only on its own seed and how many tokens it has produced, never on which other
requests share the batch, and no per-row generator state has to live anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from nanoinfer.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. Field names and defaults follow vLLM."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # a str or a list is accepted and normalized
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        def check(ok: bool, name: str, expected: str):
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}", param=name)

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        check(self.n == 1, "n", "1 (n > 1 is not supported yet)")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "an integer >= 1 or None")
        check(isinstance(self.temperature, (int, float)) and 0 <= self.temperature, "temperature", "a number >= 0")
        check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "an integer >= -1 (0 or -1 = disabled)")
        check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None")
        check(all(isinstance(s, str) and s for s in stop), "stop", "non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, seed: int) -> "SamplingParams":
        return dataclasses.replace(self, seed=seed)


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

    @classmethod
    def build(cls, params: Sequence[SamplingParams], steps: Sequence[int], vocab_size: int,
              device: torch.device | str) -> "SamplingTensors":
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=tensor([float(p.temperature) for p in params], torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor([float(p.top_p) for p in params], torch.float32),
            min_p=tensor([float(p.min_p) for p in params], torch.float32),
            seeds=tensor([(p.seed or 0) & 0xFFFF_FFFF_FFFF for p in params], torch.int64),
            steps=tensor(list(steps), torch.int64),
            all_greedy=all(p.greedy for p in params),
            needs_sort=any(not p.greedy and (k < vocab_size or p.top_p < 1) for p, k in zip(params, top_k)),
            needs_min_p=any(not p.greedy and p.min_p > 0 for p in params),
        )


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
    bits = _mix32((bits + key[:, None]) & _MASK32)
    # The top 24 bits, centred in their bucket: exactly representable, never 0 or 1.
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside the smallest set whose
    probability (renormalized after top-k) reaches top-p. The most likely token always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Next token ids [rows] (int64) from logits [rows, vocab] (fp32).

    Order per row: temperature, top-k, top-p, min-p (relative to the most likely token), then
    an exponential race: argmax(p / E) with E ~ Exp(1) draws a token with probability p
    (the Gumbel-max trick without the normalization or a host sync).
    """
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy
    scaled = logits / st.temperature.clamp_min(1e-6)[:, None]
    if st.needs_sort:
        scaled = apply_top_k_top_p(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(dim=-1)
    if st.needs_min_p:
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    exponential = -torch.log(uniform_noise(st.seeds, st.steps, logits.shape[-1]))
    sampled = (probs / exponential).argmax(dim=-1)
    return torch.where(st.temperature == 0, greedy, sampled)
