"""What a request returns: RequestOutput with one CompletionOutput per sample (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model, and the `top` alternatives (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when asked for


@dataclass(frozen=True)
class RequestOutput:
    """A request's result, or in a stream its delta since the previous item (a delta holds
    only the completions that progressed)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    # One per prompt token (None for the first, which has no context), when asked for;
    # in a stream it comes with the first item.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed again
    # Why the engine failed this request (its completions end with "error"); None otherwise.
    error: BaseException | None = None

    # The first completion's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
