"""SamplingParams: how to continue one prompt, with vLLM's field names, checked on creation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoinfer.errors import RequestError
from nanoinfer.settings import check_settings, float32_in, setting

if TYPE_CHECKING:  # (nanoinfer/structured/grammars.py is imported only by a request that constrains its output)
    from nanoinfer.structured.spec import GrammarSpec

MAX_LOGPROBS = 20
MAX_N = 128  # completions per prompt


@dataclass(frozen=True)
class SamplingParams:
    """Field names and defaults follow vLLM (and so map one-to-one onto OpenAI's)."""

    n: int = setting(1, "completions per prompt; they share the prompt's KV blocks", minimum=1, maximum=MAX_N)
    max_tokens: int | None = setting(16, "most tokens to generate (None: up to the model's context length)",
                                     minimum=1, optional=True)
    min_tokens: int = setting(0, "EOS and stop_token_ids are masked until this many tokens exist", minimum=0)
    temperature: float = setting(1.0, "0 = greedy", minimum=0, float32=True)
    top_p: float = setting(1.0, "nucleus sampling: keep the most likely tokens holding this much probability",
                           above=0, maximum=1, float32=True)
    top_k: int = setting(0, "keep the k most likely tokens (0 or -1 = all)", minimum=-1)
    min_p: float = setting(0.0, "drop tokens less likely than this share of the most likely one", minimum=0,
                           maximum=1, float32=True)
    seed: int | None = setting(None, "the same seed gives the same tokens, whatever else runs", optional=True,
                               minimum=-(1 << 63), maximum=(1 << 63) - 1)  # (int64, as vLLM and torch take it)
    presence_penalty: float = setting(0.0, "OpenAI's: minus this for every token already generated", minimum=-2,
                                      maximum=2, float32=True)
    frequency_penalty: float = setting(0.0, "OpenAI's: minus this times how often a token was generated",
                                       minimum=-2, maximum=2, float32=True)
    # Bounded: a subnormal penalty divides the logits into inf (and NaN), a huge one likewise.
    repetition_penalty: float = setting(1.0, "> 1 discourages repeating tokens of the prompt and output "
                                             "(transformers' rule; 1 = off)", minimum=0.01, maximum=100,
                                        float32=True)
    logit_bias: tuple[tuple[int, float], ...] = ()  # a {token id: bias} dict is accepted
    logprobs: int | None = setting(None, "per generated token: its logprob and this many top alternatives",
                                   minimum=0, maximum=MAX_LOGPROBS, optional=True)
    prompt_logprobs: int | None = setting(None, "the same for every prompt token after the first", minimum=0,
                                          maximum=MAX_LOGPROBS, optional=True)
    stop: tuple[str, ...] = ()  # a str or a list is accepted and normalized
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = setting(False, "keep generating past the end-of-sequence token")
    include_stop_str_in_output: bool = setting(False, "keep the stop string that ended the text")
    skip_special_tokens: bool = setting(True, "leave special tokens out of the text")
    # A GrammarSpec, or vLLM's mapping ({"json": schema} | {"regex": ...} | {"choice": [...]} |
    # {"grammar": lark} | {"json_object": true}): the output follows it (nanoinfer/structured/grammars.py).
    structured_outputs: GrammarSpec | None = None

    def __post_init__(self):
        check_settings(self)

        def check(ok: bool, name: str, expected: str):
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}", param=name)

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        check(all(isinstance(s, str) and s for s in stop), "stop", "non-empty strings")
        check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids or ()),
              "stop_token_ids", "non-negative token ids")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            check(False, "logit_bias", "a {token id: bias} mapping")
        check(all(t >= 0 and float32_in(b, -100, 100) for t, b in bias), "logit_bias",
              "token ids >= 0 mapped to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if self.structured_outputs is not None:
            from nanoinfer.structured.spec import GrammarSpec

            object.__setattr__(self, "structured_outputs", GrammarSpec.parse(self.structured_outputs))
        check(self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens", "an integer in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    def with_seed(self, seed: int) -> "SamplingParams":
        """A copy seeded with `seed`, wrapped into int64 (completion i of n takes seed + i)."""
        return dataclasses.replace(self, seed=(seed + (1 << 63)) % (1 << 64) - (1 << 63))
