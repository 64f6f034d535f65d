"""What the engine returns: per step, a TokenOutput per sequence; per request, RequestOutput with
one CompletionOutput per sample (vLLM's shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgspec

if TYPE_CHECKING:
    from runtime.engine.sequence import Sequence


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model, and the `top` alternatives (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class TokenOutput(NamedTuple):
    """One sequence's progress in one step: the token it sampled, and whether it is done. A
    sequence the engine failed reports once with no token and `seq.error` set."""

    seq: Sequence
    token_id: int | None
    finished: bool
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: tuple | None = None  # with a sequence's first token, when asked for


class Progress(NamedTuple):
    """One completion's step as its request files it (RequestState.file): made from a TokenOutput by the
    engine in this process, or decoded from an engine process's message (runtime/engine_process/messages.py)."""

    index: int  # which of the request's n completions
    token_id: int | None
    finished: bool
    finish_reason: str | None  # why it ended, when it did
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple | None = None
    error: BaseException | None = None
    scheduled_at: float | None = None  # when the engine first scheduled it (time.monotonic())
    cached_tokens: int = 0  # of the prompt, found in the prefix cache

    @classmethod
    def of(cls, out: TokenOutput) -> "Progress":
        seq = out.seq
        return cls(seq.index, out.token_id, out.finished, seq.finish_reason, out.logprob, out.prompt_logprobs,
                   seq.error, seq.scheduled_at, seq.num_cached_tokens)


class CompletionOutput(msgspec.Struct, frozen=True, gc=False):
    """One completion's text and tokens (a stream's: since its previous item). Untracked by the cyclic garbage
    collector (gc=False): what it holds (numbers, strings, tuples of them) cannot lead back to it, and a server
    front makes one a token a stream — tracked, they set off its collections (`bench/front_tokens.py --streams 512
    --repeats 3`: 1,098 collections taking 0.62 s -> 498 taking 0.28 s, bench/RESULTS.md)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when asked for


class RequestOutput(msgspec.Struct, frozen=True):
    """A request's result, or in a stream its delta since the previous item (a delta holds
    only the completions that progressed). Frozen msgspec Structs, these two: a stream makes one of each per
    token, and a frozen dataclass's __init__ was a sixth of a server front's own time a token
    (bench/front_tokens.py)."""

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
