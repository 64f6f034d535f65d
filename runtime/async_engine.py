"""AsyncEngine: asyncio front of the worker — `async for out in engine.stream(prompt, params)`.

The worker thread runs the LLMEngine's step (runtime/engine/llm_engine.py); this file is the engine's
lifecycle (the worker thread, its health and counts) and its admission of requests. The requests in flight,
how each ends and how its consumer reads it are the RequestBook's (runtime/request_book.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine_config import EngineConfig, engine_config
from runtime.engine.engine_core import CLOSED
from runtime.engine.llm_engine import EngineError, LLMEngine, Prompt
from runtime.engine.outputs import RequestOutput
from runtime.engine.request_state import RequestState, merge
from runtime.loop_inbox import LoopInbox
from runtime.request_book import RequestBook, RequestHandle, made_off_the_loop
from runtime.worker import StepReport, Worker

__all__ = ["AsyncEngine", "EngineError", "Prompt", "RequestHandle", "engine_config"]


class AsyncEngine(RequestBook):
    """Continuous batching behind an async API. Use as `async with engine:` (start/stop)."""

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig(), *, engine: LLMEngine | None = None):
        """The async front of `engine`, or of a new LLMEngine over `model` and `config`."""
        super().__init__()
        self.model, self.tokenizer = model, model.tokenizer
        self.engine = engine if engine is not None else LLMEngine(model, config)
        self.core = self.engine.core
        self.max_model_len = self.core.limits.max_model_len  # the longest prompt and output a request may have
        self._stats = self.engine.stats()
        self._worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fatal: BaseException | None = None

    @classmethod
    def from_model(cls, model: str | Path | None = None, **kwargs) -> "AsyncEngine":
        """Load `model` as `LLMEngine.from_model` does (the same keywords)."""
        engine = LLMEngine.from_model(model, **kwargs)
        return cls(engine.model, engine=engine)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._worker is not None:
            return
        if self.core.closed:  # (shut down: its memory was given back)
            raise EngineError(CLOSED)
        self._loop = asyncio.get_running_loop()
        self._worker = Worker(self.engine, LoopInbox(self._loop, self._on_reports).put)
        self._send = self._worker.submit
        self._worker.start()

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the worker thread, and release the engine's other
        processes (tensor-parallel ranks)."""
        if self._worker is not None:
            self.abort_all()
            worker, self._worker, self._send = self._worker, None, None
            await asyncio.to_thread(worker.stop)
        self.engine.close()
        self.model = self.engine.model  # (its memory given back: config and tokenizer left)

    def _on_reports(self, reports: list[StepReport]) -> None:
        """On the loop, with the steps reported since the last call: the counts, the device's health, each
        output to its consumer (several of one request's, when the loop fell behind, as one: one chunk)."""
        for report in reports:
            self._stats = report.stats
            if report.fatal is not None and self._fatal is None:
                self._fatal = report.fatal
        if len(reports) == 1:
            self._deliver(reports[0].outputs)
            return
        by_request: dict[int, tuple[RequestState, list[RequestOutput]]] = {}
        for report in reports:
            for state, out in report.outputs:
                by_request.setdefault(id(state), (state, []))[1].append(out)
        self._deliver([(state, merge(outs)) for state, outs in by_request.values()])

    @property
    def healthy(self) -> bool:
        """False once the device failed for good: restart the process."""
        return self._fatal is None

    @property
    def grammars(self):
        """Structured output's compiler (nanoinfer/structured/grammars.py's Grammars, made on first use):
        the server compiles a request's grammar there before queueing it."""
        return self.core.executor.grammars

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
        return self._add(self.engine.new_request(prompt, params, request_id=request_id, priority=priority,
                                                 chat_template_kwargs=chat_template_kwargs, stream=stream))

    async def prepare(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
                      ) -> RequestState:
        """`submit`'s checks, with a prompt that is not cheap (`cheap_to_prepare`) rendered and tokenized on a
        thread, so that a long one (a chat with 2,000 tools, a megabyte of text) never stalls the event loop; queue
        the request with `enqueue` (the server's way: every prompt of a request checked first)."""
        self._check_open(request_id)
        return await made_off_the_loop(self.engine.new_request, prompt, params, request_id=request_id,
                                       priority=priority, chat_template_kwargs=chat_template_kwargs, stream=stream)

    def enqueue(self, state: RequestState) -> RequestHandle:
        """Queue a request made by `prepare`; consume it as one from `submit`."""
        self._check_open(state.request_id)  # (again: the engine or the id may have changed meanwhile)
        return self._add(state)

    def _check_open(self, request_id: str | None) -> None:
        if self._worker is None:
            raise RuntimeError("the engine is not running: use `async with engine:` or call start()")
        if self._fatal is not None:
            raise EngineError(f"the engine is unhealthy (restart it): {self._fatal!r}") from self._fatal
        self._check_free(request_id)
