"""Speculative decoding in the engine: its configuration, and how many drafts each sequence gets.

Each step, before the plan, every decoding sequence is given up to `num_speculative_tokens`
draft tokens to verify after its pending one (fewer near its length limit). N-gram lookup
proposes them on the host right away; a draft model proposes them on the device once the plan
has given the sequence its slots (runtime/executor/draft_runner.py). The target then computes the
pending token and the drafts in one forward, and verification (nanoinfer/speculative.py)
keeps the leading drafts it accepts plus one token of its own.

A step that verifies drafts needs every sequence's tokens on the host (the proposals and
their count depend on them): the step before it is resolved first, and it is resolved at
once. Steps without drafts keep async scheduling's overlap. Speculation runs only while it
pays (`SpeculationPolicy`): a draft the target keeps rejecting switches it off.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from nanoinfer.errors import RequestError
from nanoinfer.loaders import QUANTIZATIONS
from nanoinfer.ngram import propose_ngram
from nanoinfer.settings import check_settings, json_object, setting, setting_names
from runtime.engine.sequence import Sequence

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4} or {"model": PATH, "num_speculative_tokens": 4}."""

    num_speculative_tokens: int = setting(None, "draft tokens verified per step", minimum=1, maximum=64)
    method: str | None = setting(None, "ngram, or draft_model (the default when `model` is given)", choices=METHODS,
                                 optional=True)
    model: str | None = setting(None, "the draft model (a path or short name, loaded like the target; it must "
                                      "share the target's tokenizer)", optional=True)
    prompt_lookup_max: int | None = setting(None, "ngram: the longest n-gram matched (default: "
                                                  "prompt_lookup_min, or 4)", minimum=1, optional=True)
    prompt_lookup_min: int | None = setting(None, "ngram: the shortest n-gram matched (default: 1)", minimum=1,
                                            optional=True)
    quantization: str = setting("auto", "the draft model's weights, as the engine's `quantization` (int8: a "
                                        "cheaper draft, its proposals still verified exactly)", choices=QUANTIZATIONS)
    adaptive: bool = setting(True, "speculate only while it emits tokens faster than decoding without it "
                                   "(measured; a draft the target keeps rejecting switches it off)")

    def __post_init__(self):
        check_settings(self)
        method = self.method or ("draft_model" if self.model is not None else "ngram")
        object.__setattr__(self, "method", method)
        if method == "draft_model" and self.model is None:
            raise RequestError("speculative_config: method 'draft_model' needs a 'model' (the draft's path)",
                               param="speculative_config")
        if method == "ngram" and self.quantization != "auto":
            raise RequestError(f"speculative_config: quantization={self.quantization!r} applies to a draft model, "
                               f"not to n-gram lookup", param="speculative_config")
        if method == "ngram":
            high = self.prompt_lookup_max or self.prompt_lookup_min or 4
            low = self.prompt_lookup_min or 1
            if low > high:
                raise RequestError(f"speculative_config: prompt_lookup_min={low} is above prompt_lookup_max={high}",
                                   param="speculative_config")
            object.__setattr__(self, "prompt_lookup_max", high)
            object.__setattr__(self, "prompt_lookup_min", low)

    @classmethod
    def parse(cls, name: str, value) -> "SpeculativeConfig | None":
        """From a mapping, a JSON object (the CLI flag) or a SpeculativeConfig; RequestError
        naming what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, name, 'a JSON object such as {"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - set(setting_names(cls)))
        if unknown:
            raise RequestError(f"{name}: unknown key {unknown[0]!r}: expected some of {setting_names(cls)}",
                               param=name)
        try:
            return cls(**value)
        except RequestError as exc:
            message = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
            raise RequestError(message, param=name) from exc


class SpeculationPolicy:
    """Whether the next step speculates: only while it pays. It compares the tokens per second
    that decode steps emitted with speculation and without (the median of each kind's last
    `window` measured steps: one step slowed by something else does not flip it), takes the
    faster, and every `explore_every`-th step tries the other, so that a change (a draft that
    starts or stops agreeing with the target, a batch that grows) is seen. A draft the target
    keeps rejecting thus costs one step in `explore_every`, not every step."""

    def __init__(self, adaptive: bool = True, explore_every: int = 16, window: int = 8):
        self.adaptive, self.explore_every = adaptive, explore_every
        self.samples: dict[bool, deque] = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self.steps = self.explored = 0  # steps chosen for; the last one that tried the slower kind

    def rate(self, speculated: bool) -> float | None:
        """Tokens per second of the recent steps of a kind (None before the first)."""
        samples = self.samples[speculated]
        return statistics.median(samples) if samples else None

    def choose(self) -> bool:
        self.steps += 1
        if not self.adaptive:
            return True
        fast, slow = self.rate(True), self.rate(False)
        if fast is None or slow is None:  # measure both first
            return fast is None
        best = fast >= slow
        # The further behind the other kind is, the more rarely it is tried: what a try costs
        # stays near one step's worth in `explore_every`.
        behind = max(fast, slow) / max(min(fast, slow), 1e-9)
        if self.steps - self.explored >= self.explore_every * math.ceil(behind):
            self.explored = self.steps
            return not best
        return best

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples[speculated].append(tokens / seconds)


class Speculator:
    """Decides each step's lookahead and, for n-gram lookup, the drafts themselves."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.policy = SpeculationPolicy(config.adaptive)
        self.num_proposed = self.num_accepted = 0  # draft tokens verified, and accepted (stats)
        # n-gram lookup: each running sequence's tokens as an array, grown as they are (a
        # conversion of the whole list every step would cost batch x context).
        self._arrays: dict[Sequence, np.ndarray] = {}

    def _tokens(self, seq: Sequence) -> np.ndarray:
        ids, array = seq.token_ids, self._arrays.get(seq)
        if array is None or len(array) > len(ids):  # (new, or its tokens were replaced)
            array = np.fromiter(ids, np.int64, len(ids))
        elif len(array) < len(ids):
            array = np.concatenate([array, np.array(ids[len(array):], dtype=np.int64)])
        self._arrays[seq] = array
        return array

    def lookahead(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """Set `num_lookahead` on the running sequences that decode next step; returns those
        sequences with their n-gram drafts (empty lists for a draft model: it proposes later)."""
        c, drafts = self.config, {}
        if c.method == "ngram" and len(self._arrays) > len(running):  # forget the sequences that left
            self._arrays = {seq: self._arrays[seq] for seq in running if seq in self._arrays}
        for seq in running:
            if seq.num_pending_tokens != 1 or seq.forks:
                continue
            # Drafts and the token after them must fit the sequence's length limit.
            k = min(c.num_speculative_tokens, seq.max_total_tokens - seq.num_tokens - 1)
            if k <= 0:
                continue
            if c.method == "ngram":
                ids = propose_ngram(self._tokens(seq), k, c.prompt_lookup_max, c.prompt_lookup_min)
            else:
                ids = []
            seq.num_lookahead = len(ids) if c.method == "ngram" else k
            if seq.num_lookahead:
                drafts[seq] = ids
        return drafts
