"""AsyncEngine: asyncio front of the worker — `async for out in engine.stream(prompt, params)`.

The worker thread runs the LLMEngine's step (runtime/engine/llm_engine.py); this side hands each
request's outputs to its consumer, merging them while the consumer is slow.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import AsyncIterator, Sequence

from nanoinfer.errors import RequestError
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling import SamplingParams
from runtime.config import EngineConfig, engine_config
from runtime.engine.llm_engine import EngineError, LLMEngine, Prompt, failed
from runtime.engine.outputs import CompletionOutput, RequestOutput
from runtime.engine.request_state import RequestState, merge
from runtime.worker import Abort, StepReport, Submit, Worker

__all__ = ["AsyncEngine", "EngineError", "Prompt", "RequestHandle", "engine_config"]


class RequestHandle:
    """The consumer's side of one request (see `AsyncEngine.submit`): the outputs the worker
    delivered that it has not taken yet, and whether it has ended here. Its timings and
    counts are the request's (`state`, kept by the engine thread)."""

    def __init__(self, state: RequestState):
        self.state = state
        self.pending: list[RequestOutput] = []
        self.wakeup = asyncio.Event()
        self.ended: str | None = None  # ended on this side (an abort) before the engine said so
        self.final_seen = False  # the request's last output has been taken
        self.retired = False  # out of the engine's books: finished, failed or aborted

    def __getattr__(self, name: str):  # request_id, prompt, prompt_ids, params, arrival, ...
        return getattr(self.state, name)

    @property
    def finished(self) -> bool:
        return self.ended is not None or self.state.finished

    @property
    def finish_reasons(self) -> list[str | None]:
        return [r or self.ended for r in self.state.finish_reasons]


class AsyncEngine:
    """Continuous batching behind an async API. Use as `async with engine:` (start/stop)."""

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig(), *, engine: LLMEngine | None = None):
        """The async front of `engine`, or of a new LLMEngine over `model` and `config`."""
        self.model = model
        self.engine = engine if engine is not None else LLMEngine(model, config)
        self.core = self.engine.core
        self._requests: dict[str, RequestHandle] = {}  # by request id, until retired
        self._num_seqs = 0  # sequences of the requests in `_requests`
        self._stats = self.engine.stats()
        self._worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fatal: BaseException | None = None

    @classmethod
    def from_model(cls, model: str | Path | None = None, **kwargs) -> "AsyncEngine":
        """Load `model` as `LLMEngine.from_model` does (the same keywords)."""
        engine = LLMEngine.from_model(model, **kwargs)
        return cls(engine.model, engine=engine)

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
        self._worker = Worker(self.engine, lambda report: self._loop.call_soon_threadsafe(self._on_report, report))
        self._worker.start()

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the worker thread, and release the engine's other
        processes (tensor-parallel ranks)."""
        if self._worker is not None:
            self.abort_all()
            worker, self._worker = self._worker, None
            await asyncio.to_thread(worker.stop)
        self.engine.close()

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

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
               ) -> RequestHandle:
        """Validate and queue a request now (RequestError names what is wrong); consume it
        with `collect(handle)` or `merge([handles])`. `stream` and `generate` do both.
        `chat_template_kwargs`: variables and flags for a messages prompt's chat template (see
        `LLMEngine.new_request`). `stream` false: the request's output comes once, at its end
        (a consumer that only `collect`s wakes once)."""
        self._check_open(request_id)
        return self._queue(self.engine.new_request(prompt, params, request_id=request_id, priority=priority,
                                                   chat_template_kwargs=chat_template_kwargs, stream=stream))

    async def prepare(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
                      ) -> RequestState:
        """`submit`'s checks, with the prompt rendered and tokenized on a thread, so that a long
        prompt (a chat with 2,000 tools, a megabyte of text) never stalls the event loop; queue
        the request with `enqueue` (the server's way: every prompt of a request checked first)."""
        self._check_open(request_id)
        return await asyncio.to_thread(self.engine.new_request, prompt, params, request_id=request_id,
                                       priority=priority, chat_template_kwargs=chat_template_kwargs, stream=stream)

    def enqueue(self, state: RequestState) -> RequestHandle:
        """Queue a request made by `prepare`; consume it as one from `submit`."""
        self._check_open(state.request_id)  # (again: the engine or the id may have changed meanwhile)
        return self._queue(state)

    def _check_open(self, request_id: str | None) -> None:
        if self._worker is None:
            raise RuntimeError("the engine is not running: use `async with engine:` or call start()")
        if self._fatal is not None:
            raise EngineError(f"the engine is unhealthy (restart it): {self._fatal!r}") from self._fatal
        if request_id is not None and str(request_id) in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in flight", param="request_id")

    def _queue(self, state: RequestState) -> RequestHandle:
        while state.request_id in self._requests:  # (an automatic id that a caller's took)
            state.request_id = f"{state.request_id}+"
        request = RequestHandle(state)
        state.owner = request
        self._requests[state.request_id] = request
        self._num_seqs += state.params.n
        self._worker.submit(Submit(state))
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

    # -- the one way a request ends here ---------------------------------------------------------

    def _end(self, request: RequestHandle, reason: str, error: BaseException | None = None) -> None:
        """End `request` on this side now: its consumer sees `reason` (or raises from `error`)
        at once, and the worker aborts it."""
        if not request.finished and self._worker is not None:
            request.ended = reason
            self._worker.submit(Abort(request.state))
            outputs = tuple(CompletionOutput(i, "", (), reason) for i, r in enumerate(request.state.finish_reasons)
                            if r is None)
            request.pending.append(RequestOutput(request.request_id, request.prompt, tuple(request.prompt_ids),
                                                 outputs, True, None, request.cached_tokens, error))
        self._retire(request)
        request.wakeup.set()

    def _retire(self, request: RequestHandle) -> None:
        if request.retired:
            return
        request.retired = True
        self._num_seqs -= request.params.n
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]

    def _on_report(self, report: StepReport) -> None:
        """On the loop: hand each output to its request's consumer and wake it."""
        self._stats = report.stats
        if report.fatal is not None and self._fatal is None:
            self._fatal = report.fatal
        for state, out in report.outputs:
            request: RequestHandle = state.owner
            if request.ended is not None:
                continue  # ended here already (an abort): nothing more reaches its consumer
            request.pending.append(out)
            if out.finished:
                self._retire(request)
            request.wakeup.set()

    # -- consuming ------------------------------------------------------------------------------

    @staticmethod
    def _take(request: RequestHandle) -> RequestOutput | None:
        """What arrived for `request` since the last call, as one output (None: nothing new).
        Raises EngineError if the engine failed it."""
        if not request.pending:
            return None
        out, request.pending = merge(request.pending), []
        request.final_seen = out.finished
        if out.error is not None:
            raise failed(out)
        return out

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
            async for out in self._outputs(request):
                yield out
        finally:  # (closing this generator does not close the inner one: release now, not at its collection)
            self.release(request)

    async def _outputs(self, request: RequestHandle) -> AsyncIterator[RequestOutput]:
        """`request`'s outputs as they arrive, until its last; released however the loop ends."""
        try:
            while not request.final_seen:
                await request.wakeup.wait()
                request.wakeup.clear()
                out = self._take(request)
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
        wakeup.set()  # (outputs may have arrived before this started)
        try:
            while not all(r.final_seen for r in requests):
                await wakeup.wait()
                wakeup.clear()
                for i, request in enumerate(requests):
                    out = self._take(request)
                    if out is not None:
                        yield i, out
        finally:
            for request in requests:
                self.release(request)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, chat_template_kwargs: dict | None = None) -> RequestOutput:
        """Run one request to completion; the whole text and ids."""
        return await self.collect(self.submit(prompt, params, request_id, priority, chat_template_kwargs,
                                              stream=False))

    async def collect(self, request: RequestHandle) -> RequestOutput:
        """Wait for a submitted request's end; the whole text, ids and logprobs of each
        completion. Cancelling the wait aborts the request."""
        parts = [out async for out in self._outputs(request)]
        whole = merge(parts)
        n = request.params.n
        if len(whole.outputs) < n:  # (every completion, even one that produced nothing)
            have = {c.index for c in whole.outputs}
            whole = dataclasses.replace(whole, outputs=tuple(sorted(
                whole.outputs + tuple(CompletionOutput(i, "", (), None) for i in range(n) if i not in have),
                key=lambda c: c.index)))
        return dataclasses.replace(whole, finished=True)
