"""SamplingParams: how to continue one prompt, with vLLM's field names, checked on creation."""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass

from nanoinfer.errors import RequestError

MAX_LOGPROBS = 20


def float32_in(value, low: float = -math.inf, high: float = math.inf, *, low_open: bool = False) -> bool:
    """Whether `value` is a real number that, rounded to float32 (the precision the sampler
    computes in), is finite and in [low, high] — (low, high] with `low_open`. A check in
    float64 passes 1e-50 as a top-p or a penalty, which then reaches the sampler as 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        x = struct.unpack("f", struct.pack("f", float(value)))[0]  # past float32's range: inf
    except OverflowError:  # an int past any float's range
        return False
    return math.isfinite(x) and (low < x if low_open else low <= x) and x <= high


@dataclass(frozen=True)
class SamplingParams:
    """Field names and defaults follow vLLM (and so map one-to-one onto OpenAI's)."""

    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often it was generated
    repetition_penalty: float = 1.0  # transformers: divide (positive) or multiply (negative)
    # the logits of tokens in the prompt or the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # a {token id: bias} dict is accepted
    logprobs: int | None = None  # per generated token: its logprob and the top-k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    stop: tuple[str, ...] = ()  # a str or a list is accepted and normalized
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        def check(ok: bool, name: str, expected: str):
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}", param=name)

        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        check(all(isinstance(s, str) and s for s in stop), "stop", "non-empty strings")
        check(all(integer(t) and t >= 0 for t in self.stop_token_ids or ()), "stop_token_ids",
              "non-negative token ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            check(False, "logit_bias", "a {token id: bias} mapping")
        check(all(t >= 0 and float32_in(b, -100, 100) for t, b in bias), "logit_bias",
              "token ids >= 0 mapped to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        check(integer(self.n) and 1 <= self.n <= 128, "n", "an integer in [1, 128]")
        check(self.max_tokens is None or (integer(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "an integer >= 1 or None")
        check(integer(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
              "min_tokens", "an integer in [0, max_tokens]")
        check(float32_in(self.temperature, 0), "temperature", "a finite number >= 0 (in float32)")
        check(float32_in(self.top_p, 0, 1, low_open=True), "top_p", "a number in (0, 1] (in float32)")
        check(integer(self.top_k) and self.top_k >= -1, "top_k", "an integer >= -1 (0 or -1 = disabled)")
        check(float32_in(self.min_p, 0, 1), "min_p", "a number in [0, 1]")
        check(self.seed is None or integer(self.seed), "seed", "an integer or None")
        check(float32_in(self.presence_penalty, -2, 2), "presence_penalty", "a number in [-2, 2]")
        check(float32_in(self.frequency_penalty, -2, 2), "frequency_penalty", "a number in [-2, 2]")
        check(float32_in(self.repetition_penalty, 0, low_open=True), "repetition_penalty",
              "a finite number > 0 (in float32; 1 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (integer(value) and 0 <= value <= MAX_LOGPROBS), name,
                  f"an integer in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    def with_seed(self, seed: int) -> "SamplingParams":
        return dataclasses.replace(self, seed=seed)
