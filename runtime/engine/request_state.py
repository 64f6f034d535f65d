"""RequestState: one request's outputs as they come from the engine core — tokens filed per
completion, text detokenized incrementally, stop strings matched, and RequestOutputs made.

The engine core knows tokens; this turns them into what a caller reads. A request either
streams (each `take` hands out what is new since the last: a delta) or waits for its end
(`take` answers once, with everything). A request that does not stream detokenizes only at its
end, unless it has stop strings, which are matched as its tokens arrive.
"""

from __future__ import annotations

import time

from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.detokenizer import IncrementalDetokenizer
from runtime.engine.outputs import CompletionOutput, Progress, RequestOutput, TokenLogprob


class _Completion:
    """One of a request's n completions: every token and logprob so far, how many of them were
    handed out, and how it ended."""

    def __init__(self, detok: IncrementalDetokenizer | None):
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.fed = 0  # tokens given to the detokenizer
        self.sent = 0  # tokens handed out
        self.finish_reason: str | None = None
        self.reported = False  # its end has been handed out


class RequestState:
    """One request from its submission to its last output. The engine core knows the request
    by this object (`seq.request`), so outputs need no lookup and an id may be reused at once.
    `owner` is the caller's own handle for it (AsyncEngine's), if any."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, *, priority: int = 0, stream: bool = True):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.priority, self.stream = priority, stream
        # A stream's deltas: every step (1), or once this many tokens have gathered (`serve --stream-interval`:
        # fewer, larger chunks, for a front that spends its core on many streams); its first token and its
        # end go out at once.
        self.stream_interval = 1
        self.completions = [_Completion(self._detokenizer(tokenizer)) for _ in range(params.n)]
        self.num_unfinished = params.n  # completions without a finish reason (read at every step)
        self.prompt_logprobs: tuple | None = None
        self._prompt_logprobs_sent = False
        self._prompt_ids_tuple: tuple[int, ...] | None = None
        self.error: BaseException | None = None
        self.owner = None
        self.stopped: list[int] = []  # completions a stop string ended since the engine last looked
        # time.monotonic() of the request's milestones, for logs and metrics.
        self.arrival = time.monotonic()
        self.scheduled_at: float | None = None
        self.cached_tokens = 0  # of the prompt, found in the prefix cache (OpenAI's usage reports it)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.token_gaps: list[float] = []  # seconds between a completion's tokens (inter-token latency)
        self._last_token_at: float | None = None

    def _detokenizer(self, tokenizer) -> IncrementalDetokenizer | None:
        if tokenizer is None:
            return None
        p = self.params
        return IncrementalDetokenizer(tokenizer, self.prompt_ids, skip_special_tokens=p.skip_special_tokens,
                                      stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.completions]

    # -- from the engine core ---------------------------------------------------------------

    def file(self, out: Progress, now: float) -> None:
        """One completion's progress in one step: its token, its end, or the request's failure."""
        if self.scheduled_at is None:  # (the first output is completion 0's, which found the prefix cache)
            self.scheduled_at, self.cached_tokens = out.scheduled_at, out.cached_tokens
        if out.error is not None:
            self.end("error", out.error)
            return
        c = self.completions[out.index]
        if c.finish_reason is not None:
            return  # ended here already (a stop string, an abort)
        if out.token_id is not None:
            c.token_ids.append(out.token_id)
            if out.logprob is not None:
                c.logprobs.append(out.logprob)
            if self.first_token_at is None:
                self.first_token_at = now
            elif self._last_token_at is not None and self._last_token_at != now:
                self.token_gaps.append(now - self._last_token_at)
            self._last_token_at = now
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self._finish(c, out.finish_reason)

    def end(self, reason: str, error: BaseException | None = None) -> None:
        """End every unfinished completion with `reason` (an abort, or the engine failing it
        with `error`). A request that already ended keeps its result."""
        unfinished = [c for c in self.completions if c.finish_reason is None]
        if error is not None and self.error is None and unfinished:
            self.error = error
        for c in unfinished:
            self._finish(c, reason)

    def _finish(self, c: _Completion, reason: str) -> None:
        if c.finish_reason is None:
            self.num_unfinished -= 1
            if self.num_unfinished == 0:
                self.finished_at = time.monotonic()
        c.finish_reason = reason

    # -- to the caller ------------------------------------------------------------------------

    def take(self) -> RequestOutput | None:
        """What to hand out now: a streaming request's delta since the last call, or a waiting
        request's whole output once it has ended (None: nothing yet). A completion that a stop
        string ended is listed in `stopped` (its tokens past the stop are dropped)."""
        if self.error is not None:
            return self._failed()
        stream, stop = self.stream, self.params.stop
        if not (stream or stop or self.num_unfinished == 0):
            return None  # (waiting for its end, no stop strings: nothing to do at this step)
        gather = stream and self.stream_interval > 1
        if gather and not stop and not self._interval_due():
            return None  # (its tokens gather until the next delta: detokenized then, all at once)
        # (past here a completion's new tokens are detokenized: it streams, has stop strings or has ended)
        for index, c in enumerate(self.completions):
            detok = c.detok
            if detok is None:
                c.fed = len(c.token_ids)
            elif c.fed < len(c.token_ids) and not detok.stopped:
                c.fed += detok.add(c.token_ids[c.fed:])
                if detok.stopped:
                    # A stop string ended it: its tokens end with the one that completed it,
                    # whatever else arrived meanwhile.
                    del c.token_ids[c.fed:]
                    del c.logprobs[c.fed:]
                    if c.finish_reason is None:
                        self.stopped.append(index)
                    self._finish(c, "stop")
        if not stream and self.num_unfinished:
            return None
        if gather and not self._interval_due():
            return None  # (stop strings are matched at every step, so the engine stops at once; the delta gathers)
        outputs = []
        want_logprobs = self.params.logprobs is not None
        for index, c in enumerate(self.completions):
            if c.reported:
                continue
            ending = c.finish_reason is not None
            sent = c.sent
            ids = tuple(c.token_ids[sent:])
            text = c.detok.take_delta(ending) if c.detok is not None else ""
            if ids or text or ending:
                logprobs = tuple(c.logprobs[sent:sent + len(ids)]) if want_logprobs else None
                c.sent = sent + len(ids)
                c.reported = ending
                outputs.append(CompletionOutput(index, text, ids, c.finish_reason, logprobs))
        if not outputs:
            return None
        return self._output(tuple(outputs))

    def _output(self, outputs: tuple[CompletionOutput, ...], error: BaseException | None = None) -> RequestOutput:
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt_logprobs, self._prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids_tuple, outputs, self.finished,
                             prompt_logprobs, self.cached_tokens, error)

    @property
    def prompt_ids_tuple(self) -> tuple[int, ...]:
        """The prompt's ids as every output of the request carries them: made once, where a tuple of a long prompt
        made at each of a stream's steps was a server front's cost a token (bench/front_tokens.py)."""
        if self._prompt_ids_tuple is None:
            self._prompt_ids_tuple = tuple(self.prompt_ids)
        return self._prompt_ids_tuple

    def _interval_due(self) -> bool:
        """Whether a completion has a delta to hand out under `stream_interval`: its first token, an
        interval's worth of tokens, or its end."""
        every = self.stream_interval
        return any((c.sent == 0 and c.token_ids) or len(c.token_ids) - c.sent >= every
                   or (c.finish_reason is not None and not c.reported) for c in self.completions)

    def _failed(self) -> RequestOutput | None:
        """The one output of a request the engine failed: its completions end with "error"."""
        if all(c.reported for c in self.completions):
            return None
        outputs = []
        for index, c in enumerate(self.completions):
            if not c.reported:
                c.reported = True
                outputs.append(CompletionOutput(index, "", (), c.finish_reason))
        return self._output(tuple(outputs), self.error)

    @property
    def done(self) -> bool:
        """Everything has been handed out."""
        return self.finished and all(c.reported for c in self.completions)


def merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one (a slow consumer's backlog)."""
    if len(outputs) == 1:
        return outputs[0]
    by_index: dict[int, list[CompletionOutput]] = {}
    for out in outputs:
        for c in out.outputs:
            by_index.setdefault(c.index, []).append(c)
    merged = []
    for index in sorted(by_index):
        parts = by_index[index]
        logprobs = None if all(p.logprobs is None for p in parts) else tuple(lp for p in parts for lp in p.logprobs or ())
        merged.append(CompletionOutput(index, "".join(p.text for p in parts),
                                       tuple(t for p in parts for t in p.token_ids), parts[-1].finish_reason, logprobs))
    last = outputs[-1]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    error = next((o.error for o in outputs if o.error is not None), None)
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, tuple(merged), last.finished,
                         prompt_logprobs, last.num_cached_tokens, error)
