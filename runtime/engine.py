"""AsyncEngine: asyncio front of the worker — `async for out in engine.stream(prompt, params)`."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import AsyncIterator, Sequence, Union

from nanoinfer.errors import NanoInferError, RequestError
from nanoinfer.loaders import LoadedModel, load_model
from nanoinfer.sampling import SamplingParams
from nanoinfer.settings import split_kwargs
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_core import EngineConfig, EngineCore
from runtime.outputs import CompletionOutput, RequestOutput, TokenLogprob
from runtime.scheduler import SchedulerConfig
from runtime.worker import Abort, StepReport, Submit, Worker

# A prompt is text, token ids, or chat messages ({"role", "content"} dicts).
Prompt = Union[str, Sequence[int], Sequence[dict]]


class EngineError(NanoInferError, RuntimeError):
    """A request failed inside the engine (its own fault, or the engine's: `__cause__` says);
    other requests went on, unless `engine.healthy` is now False."""


class _Completion:
    """Loop-side state of one of a request's n completions: tokens the worker sent that the
    consumer has not taken yet (coalesced while it is slow), and how it ended."""

    def __init__(self, detok: IncrementalDetokenizer | None):
        self.detok = detok
        self.pending: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.reported = False  # its end has been handed to the consumer
        self.num_tokens = 0


class RequestHandle:
    """Loop-side state of one request (see `AsyncEngine.submit`): the request's one identity.
    The worker knows it by this object, so its events need no lookup and a closed request's
    id is free again at once."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 completions: list[_Completion]):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.completions = completions
        self.prompt_logprobs: tuple | None = None
        self.prompt_logprobs_sent = False
        self.error: BaseException | None = None
        self.wakeup = asyncio.Event()
        # Wake the consumer at every step's tokens (streaming, stop strings), or only at the
        # end (`collect` without stop strings: no per-step task switch for each of a
        # batch's hundreds of requests, which would compete with the worker for the GIL).
        self.wake_each_step = True
        self.retired = False  # out of the engine's books: finished, failed or aborted
        # time.monotonic() of the request's milestones, for logs and metrics.
        self.arrival = time.monotonic()
        self.scheduled_at: float | None = None
        self.cached_tokens = 0  # of the prompt, found in the prefix cache (OpenAI's usage reports it)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.token_gaps: list[float] = []  # seconds between a completion's tokens (inter-token latency)
        self._last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)

    @property
    def finish_reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.completions]


def engine_config(**engine_args) -> EngineConfig:
    """EngineConfig from the flat engine arguments users pass to LLM/AsyncEngine: the settings
    of EngineConfig and SchedulerConfig (an unknown name is a RequestError listing them)."""
    engine, scheduler = split_kwargs(engine_args, EngineConfig, SchedulerConfig, what="engine")
    return EngineConfig(**engine, scheduler=SchedulerConfig(**scheduler))


class AsyncEngine:
    """Continuous batching behind an async API. Use as `async with engine:` (start/stop)."""

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.core = EngineCore(model, config)
        self._requests: dict[str, RequestHandle] = {}  # by request id, until retired
        self._num_seqs = 0  # sequences of the requests in `_requests`
        self._ids = itertools.count()
        self._stats = self.core.stats()
        self._worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fatal: BaseException | None = None

    @classmethod
    def from_model(cls, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
                   progress: bool = True, load_format: str = "auto", quantization: str = "auto",
                   gguf_file: str | None = None, **engine_args) -> "AsyncEngine":
        """Load `model` (a short name, HF directory, .gguf or Hub id; None = the default model) as
        `load_model` does. `engine_args` are those of `engine_config`."""
        config = engine_config(**engine_args)
        return cls(load_model(model, device=device, dtype=dtype, progress=progress, load_format=load_format,
                              quantization=quantization, gguf_file=gguf_file), config)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> "AsyncEngine":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def start(self) -> None:
        if self._worker is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._worker = Worker(self.core, lambda report: self._loop.call_soon_threadsafe(self._on_report, report))
        self._worker.start()

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the worker thread, and release the engine's other
        processes (tensor-parallel ranks)."""
        if self._worker is not None:
            self.abort_all()
            worker, self._worker = self._worker, None
            await asyncio.to_thread(worker.stop)
        self.core.close()

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished (waiting, running or swapped)."""
        return len(self._requests)

    @property
    def num_seqs_in_flight(self) -> int:
        """Their sequences: a request with n completions counts n."""
        return self._num_seqs

    @property
    def healthy(self) -> bool:
        """False once the device failed for good: restart the process."""
        return self._fatal is None

    def stats(self) -> dict:
        """Counts from the last step: running, waiting, swapped, free_blocks, total_blocks,
        num_preemptions, generated_tokens, steps; plus healthy."""
        return {**self._stats, "healthy": self.healthy}

    # -- requests ----------------------------------------------------------------------------

    def _prepare(self, prompt: Prompt, chat_template_kwargs: dict | None = None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer: pass the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer, so no chat template")
            text = self.tokenizer.apply_chat_template(items, add_generation_prompt=True, **(chat_template_kwargs or {}))
            # The template writes BOS itself where the model wants one: add no specials again.
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise RequestError("prompt must be a string, a list of token ids, or a list of chat messages (dicts)")
        return None, items

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0, chat_template_kwargs: dict | None = None) -> RequestHandle:
        """Validate and queue a request now (RequestError names what is wrong); consume it
        with `collect(handle)` or `merge([handles])`. `stream` and `generate` do both.
        `chat_template_kwargs`: extra variables for the chat template of a messages prompt
        (`tools`, `enable_thinking`, ...)."""
        if self._worker is None:
            raise RuntimeError("the engine is not running: use `async with engine:` or call start()")
        if self._fatal is not None:
            raise EngineError(f"the engine is unhealthy (restart it): {self._fatal!r}") from self._fatal
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int):
            raise RequestError(f"priority={priority!r} is invalid: expected an integer")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in flight", param="request_id")
        text, ids = self._prepare(prompt, chat_template_kwargs)
        ids = self.core.check_request(ids, params)  # fail this consumer now, not the worker later
        if params.stop and self.tokenizer is None:
            raise RequestError(f"{self.model.path} has no tokenizer, so stop strings cannot be matched: use "
                               f"stop_token_ids", param="stop")

        def detok():
            if self.tokenizer is None:
                return None
            return IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                          stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

        request = RequestHandle(request_id, text, ids, params, [_Completion(detok()) for _ in range(params.n)])
        self._requests[request_id] = request
        self._num_seqs += params.n
        self._worker.submit(Submit(request, ids, params, priority))
        return request

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" and its blocks are freed
        at the worker's next command drain (within one step)."""
        request = self._requests.get(str(request_id))
        if request is not None:
            self._end(request, "abort")

    def abort_all(self, error: BaseException | None = None) -> None:
        """Abort every request in flight (shutdown: their streams end at once). With `error`,
        each consumer raises EngineError from it (a server ending what it could not finish)
        instead of seeing finish_reason "abort"."""
        for request in list(self._requests.values()):
            self._end(request, "abort", error)

    # -- the one way a request ends ------------------------------------------------------------

    def _end(self, request: RequestHandle, reason: str, error: BaseException | None = None,
             tell_worker: bool = True) -> None:
        """End every unfinished completion of `request` with `reason`, take it off the books and
        wake its consumer. `tell_worker`: the worker may still be running it (an abort)."""
        unfinished = [c for c in request.completions if c.finish_reason is None]
        if error is not None and request.error is None and unfinished:
            request.error = error  # (a request that already ended, by a stop string say, keeps its result)
        for c in unfinished:
            c.finish_reason = reason
        if unfinished and tell_worker and self._worker is not None:
            self._worker.submit(Abort(request, reason))
        self._retire(request)
        request.wakeup.set()

    def _retire(self, request: RequestHandle) -> None:
        if request.retired:
            return
        request.retired = True
        request.finished_at = time.monotonic()
        self._num_seqs -= len(request.completions)
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]

    def _on_report(self, report: StepReport) -> None:
        """On the loop: file each token with its request and wake its consumer."""
        self._stats = report.stats
        now = time.monotonic()
        if report.fatal is not None and self._fatal is None:
            self._fatal = report.fatal
        woken = []
        for event in report.events:
            request: RequestHandle = event.request
            if request.scheduled_at is None and event.scheduled_at is not None:
                request.scheduled_at = event.scheduled_at
            if event.index == 0:
                request.cached_tokens = event.cached_tokens
            if event.error is not None:
                self._end(request, "error", event.error, tell_worker=False)
                continue
            completion = request.completions[event.index]
            if completion.finish_reason is not None:
                continue  # ended here already (a stop string, an abort)
            if event.token_id is not None:
                completion.pending.append(event.token_id)
                completion.num_tokens += 1
                if event.logprob is not None:
                    completion.pending_logprobs.append(event.logprob)
                if request.first_token_at is None:
                    request.first_token_at = now
                elif request._last_token_at is not None and request._last_token_at != now:
                    request.token_gaps.append(now - request._last_token_at)
                request._last_token_at = now
            if event.prompt_logprobs is not None:
                request.prompt_logprobs = event.prompt_logprobs
            if event.finish_reason is not None:
                completion.finish_reason = event.finish_reason
                if request.finished:
                    self._retire(request)
                request.wakeup.set()
            elif request.wake_each_step:
                woken.append(request)
        for request in woken:
            request.wakeup.set()

    # -- consuming ------------------------------------------------------------------------------

    def _take_delta(self, request: RequestHandle) -> RequestOutput | None:
        """What arrived for `request` since the last call, as a delta (None: nothing new).
        Raises EngineError if the engine failed it."""
        if request.error is not None:
            raise EngineError(f"request {request.request_id} failed: {request.error}") from request.error
        outputs = []
        for index, c in enumerate(request.completions):
            new_ids, c.pending = c.pending, []
            new_logprobs, c.pending_logprobs = c.pending_logprobs, []
            text = ""
            if c.detok is not None and not c.reported:
                was_stopped = c.detok.stopped
                taken = c.detok.add(new_ids)
                if c.detok.stopped and not was_stopped:
                    # A stop string ended it: its tokens end with the one that completed it,
                    # whatever else arrived meanwhile (a slow consumer's coalesced delta).
                    c.num_tokens -= len(new_ids) - taken
                    new_ids, new_logprobs = new_ids[:taken], new_logprobs[:taken]
                    if c.finish_reason is None and self._worker is not None:
                        self._worker.submit(Abort(request, "stop", index))  # finish here, free there
                    c.finish_reason = "stop"
                    if request.finished:
                        self._retire(request)
                text = c.detok.take_delta(final=c.finish_reason is not None)
            ending = c.finish_reason is not None and not c.reported
            if new_ids or text or ending:
                c.reported = c.finish_reason is not None
                outputs.append(CompletionOutput(index, text, tuple(new_ids), c.finish_reason,
                                                tuple(new_logprobs) if request.params.logprobs is not None else None))
        if not outputs:
            return None
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(request.request_id, request.prompt, tuple(request.prompt_ids), tuple(outputs),
                             request.finished, prompt_logprobs, request.cached_tokens)

    @staticmethod
    def _done(request: RequestHandle) -> bool:
        return request.finished and all(c.reported for c in request.completions)

    def release(self, request: RequestHandle) -> None:
        """The consumer is gone: abort the request if it is still running (synchronously, so
        its id is free again and its blocks are freed within a step)."""
        if not request.finished:
            self._end(request, "abort")
        self._retire(request)

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                     priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress as deltas: each item carries only the new text and ids;
        the last has `finish_reason` set. Leaving the loop early, or `aclose()`, aborts it."""
        request = self.submit(prompt, params, request_id, priority)
        try:
            while not self._done(request):
                await request.wakeup.wait()
                request.wakeup.clear()
                out = self._take_delta(request)
                if out is not None:
                    yield out
        finally:
            self.release(request)

    async def merge(self, requests: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(position in `requests`, delta) from several submitted requests as they progress;
        leaving early aborts those still running (the server's multi-prompt streams)."""
        wakeup = asyncio.Event()
        for request in requests:  # one event for all: one wait covers every request
            request.wakeup = wakeup
        wakeup.set()  # (tokens may have arrived before this started)
        try:
            while not all(self._done(r) for r in requests):
                await wakeup.wait()
                wakeup.clear()
                for i, request in enumerate(requests):
                    out = None if self._done(request) else self._take_delta(request)
                    if out is not None:
                        yield i, out
        finally:
            for request in requests:
                self.release(request)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, chat_template_kwargs: dict | None = None) -> RequestOutput:
        """Run one request to completion; the whole text and ids."""
        return await self.collect(self.submit(prompt, params, request_id, priority, chat_template_kwargs))

    async def collect(self, request: RequestHandle) -> RequestOutput:
        """Wait for a submitted request's end; the whole text, ids and logprobs of each
        completion. Cancelling the wait aborts the request."""
        request.wake_each_step = bool(request.params.stop)  # stop strings are matched as text arrives
        n = len(request.completions)
        texts, ids, logprobs, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        prompt_logprobs = None
        try:
            while not self._done(request):
                await request.wakeup.wait()
                request.wakeup.clear()
                out = self._take_delta(request)
                for c in out.outputs if out is not None else ():
                    texts[c.index].append(c.text)
                    ids[c.index].extend(c.token_ids)
                    logprobs[c.index].extend(c.logprobs or ())
                    reasons[c.index] = c.finish_reason or reasons[c.index]
                if out is not None and out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
        finally:
            self.release(request)
        wants_logprobs = request.params.logprobs is not None
        completions = tuple(CompletionOutput(i, "".join(texts[i]), tuple(ids[i]), reasons[i],
                                             tuple(logprobs[i]) if wants_logprobs else None) for i in range(n))
        return RequestOutput(request.request_id, request.prompt, tuple(request.prompt_ids), completions, True,
                             prompt_logprobs, request.cached_tokens)
