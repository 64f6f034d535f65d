"""AsyncEngine: asyncio front of the worker — `async for out in engine.stream(prompt, params)`."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import AsyncIterator, Sequence, Union

from nanoinfer.errors import NanoInferError, RequestError
from nanoinfer.loaders import LoadedModel, load_model
from nanoinfer.sampling import SamplingParams
from runtime.detokenizer import IncrementalDetokenizer
from runtime.engine_core import EngineConfig, EngineCore
from runtime.outputs import CompletionOutput, RequestOutput, TokenLogprob
from runtime.scheduler import SchedulerConfig
from runtime.worker import Abort, StepReport, Submit, Worker

# A prompt is text, token ids, or chat messages ({"role", "content"} dicts).
Prompt = Union[str, Sequence[int], Sequence[dict]]


class EngineError(NanoInferError, RuntimeError):
    """The engine failed while running a step; requests in flight end with this error."""


class _Completion:
    """Loop-side state of one of a request's n completions: tokens the worker sent that the
    consumer has not taken yet (coalesced while it is slow), and how it ended."""

    def __init__(self, detok: IncrementalDetokenizer | None):
        self.detok = detok
        self.pending: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.reported = False  # its end has been handed to the consumer


class RequestHandle:
    """Loop-side state of one request (see `AsyncEngine.submit`)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 completions: list[_Completion]):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.completions = completions
        self.prompt_logprobs: tuple | None = None
        self.error: BaseException | None = None
        self.wakeup = asyncio.Event()
        # Wake the consumer at every step's tokens (streaming, stop strings), or only at the
        # end (`collect` without stop strings: no per-step task switch for each of a
        # batch's hundreds of requests, which would compete with the worker for the GIL).
        self.wake_each_step = True

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def end(self, reason: str) -> None:
        for c in self.completions:
            if c.finish_reason is None:
                c.finish_reason = reason


def engine_config(*, block_size: int = 16, num_blocks: int | None = None, kv_cache_memory: int | None = None,
                  swap_space: int = 0, max_model_len: int | None = None, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 4096, scheduling_policy: str = "fcfs",
                  preemption_mode: str = "recompute", aging_steps: int = 64, gpu_memory_utilization: float = 0.9,
                  enforce_eager: bool = False, nvtx: bool = False,
                  async_scheduling: bool | None = None) -> EngineConfig:
    """EngineConfig from the flat engine arguments users pass to LLM/AsyncEngine."""
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                policy=scheduling_policy, preemption_mode=preemption_mode, aging_steps=aging_steps)
    return EngineConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                        swap_space=swap_space, max_model_len=max_model_len,
                        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, nvtx=nvtx,
                        async_scheduling=async_scheduling, scheduler=scheduler)


class AsyncEngine:
    """Continuous batching behind an async API. Use as `async with engine:` (start/stop)."""

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.core = EngineCore(model, config)
        self._requests: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._stats = self.core.stats()
        self._worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_model(cls, model: str | Path | None = None, *, device: str = "auto", dtype: str = "auto",
                   progress: bool = True, **engine_args) -> "AsyncEngine":
        """Load `model` (a short name, HF directory or .gguf; None = the default model).
        `engine_args` are those of `engine_config`."""
        config = engine_config(**engine_args)
        return cls(load_model(model, device=device, dtype=dtype, progress=progress), config)

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
        """Abort what is in flight and stop the worker thread."""
        if self._worker is None:
            return
        self.abort_all()
        worker, self._worker = self._worker, None
        await asyncio.to_thread(worker.stop)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished (waiting, running or swapped)."""
        return len(self._requests)

    @property
    def healthy(self) -> bool:
        return self._error is None

    def stats(self) -> dict:
        """Counts from the last step: running, waiting, swapped, free_blocks, total_blocks,
        num_preemptions, generated_tokens, steps; plus healthy."""
        return {**self._stats, "healthy": self.healthy}

    # -- requests ----------------------------------------------------------------------------

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer: pass the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if self.tokenizer is None:
                raise RequestError(f"{self.model.path} has no tokenizer, so no chat template")
            text = self.tokenizer.apply_chat_template(items, add_generation_prompt=True)
            # The template writes BOS itself where the model wants one: add no specials again.
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise RequestError("prompt must be a string, a list of token ids, or a list of chat messages (dicts)")
        return None, items

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0) -> "RequestHandle":
        """Validate and queue a request now (RequestError names what is wrong); consume it
        with `follow(handle)` or `collect(handle)`. `stream` and `generate` do both."""
        if self._worker is None:
            raise RuntimeError("the engine is not running: use `async with engine:` or call start()")
        if self._error is not None:
            raise EngineError(f"the engine is unhealthy after an error in a step: {self._error!r}") from self._error
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int):
            raise RequestError(f"priority={priority!r} is invalid: expected an integer")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")
        text, ids = self._prepare(prompt, params)
        ids = self.core.check_request(ids, params)  # fail this consumer now, not the worker later
        def detok():
            if self.tokenizer is None:
                return None
            return IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                          stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

        request = RequestHandle(request_id, text, ids, params, [_Completion(detok()) for _ in range(params.n)])
        self._requests[request_id] = request
        self._worker.submit(Submit(request_id, ids, params, priority))
        return request

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" and its blocks are freed
        at the worker's next command drain (within one step)."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            return
        if request.error is None:
            request.end("abort")
        request.wakeup.set()
        if self._worker is not None:
            self._worker.submit(Abort(request.request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (graceful shutdown: their streams end at once)."""
        for rid in list(self._requests):
            self.abort(rid)

    def _on_report(self, report: StepReport) -> None:
        """On the loop: file each token with its request and wake its consumer."""
        self._stats = report.stats
        for event in report.events:
            request = self._requests.get(event.request_id)
            if request is None:
                continue  # aborted meanwhile
            completion = request.completions[event.index]
            if completion.finish_reason is not None:
                continue  # ended here already (a stop string)
            completion.pending.append(event.token_id)
            if event.logprob is not None:
                completion.pending_logprobs.append(event.logprob)
            if event.prompt_logprobs is not None:
                request.prompt_logprobs = event.prompt_logprobs
            if event.finish_reason is not None:
                completion.finish_reason = event.finish_reason
                if request.finished:
                    self._requests.pop(event.request_id, None)
                request.wakeup.set()
            elif request.wake_each_step:
                request.wakeup.set()
        if report.error is not None:
            if not isinstance(report.error, RequestError) or len(report.failed) != 1:
                self._error = report.error
            for rid in report.failed:
                request = self._requests.pop(rid, None)
                if request is not None:
                    request.error = report.error
                    request.wakeup.set()

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                     priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress as deltas: each item carries only the new text and ids;
        the last has `finish_reason` set. Leaving the loop early aborts the request."""
        request = self.submit(prompt, params, request_id, priority)
        async for out in self.follow(request):
            yield out

    async def follow(self, request: RequestHandle) -> AsyncIterator[RequestOutput]:
        """The deltas of a submitted request (see `stream`)."""
        prompt_logprobs_sent = False
        try:
            while True:
                await request.wakeup.wait()
                request.wakeup.clear()
                if request.error is not None:
                    raise EngineError(f"request {request.request_id} failed: {request.error!r}") from request.error
                outputs = []
                for index, c in enumerate(request.completions):
                    new_ids, c.pending = c.pending, []
                    new_logprobs, c.pending_logprobs = c.pending_logprobs, []
                    text = ""
                    if c.detok is not None:
                        c.detok.add(new_ids)
                        if c.detok.stopped and c.finish_reason is None:
                            # A stop string ended it before the worker knew: finish here, free there.
                            c.finish_reason = "stop"
                            if self._worker is not None:
                                self._worker.submit(Abort(request.request_id, "stop", index))
                        text = c.detok.take_delta(final=c.finish_reason is not None)
                    ending = c.finish_reason is not None and not c.reported
                    if new_ids or text or ending:
                        c.reported = c.finish_reason is not None
                        outputs.append(CompletionOutput(index, text, tuple(new_ids), c.finish_reason,
                                                        tuple(new_logprobs) if request.params.logprobs is not None
                                                        else None))
                finished = request.finished
                if finished:
                    self._requests.pop(request.request_id, None)
                if outputs:
                    prompt_logprobs = None
                    if request.prompt_logprobs is not None and not prompt_logprobs_sent:
                        prompt_logprobs, prompt_logprobs_sent = request.prompt_logprobs, True
                    yield RequestOutput(request.request_id, request.prompt, tuple(request.prompt_ids), tuple(outputs),
                                        finished, prompt_logprobs)
                if finished:
                    return
        finally:
            if not request.finished and request.error is None:
                self.abort(request.request_id)  # the consumer left early (break, cancel)
            self._requests.pop(request.request_id, None)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0) -> RequestOutput:
        """Run one request to completion; the whole text and ids."""
        return await self.collect(self.submit(prompt, params, request_id, priority))

    async def collect(self, request: RequestHandle) -> RequestOutput:
        """Follow a request to its end; the whole text, ids and logprobs of each completion."""
        request.wake_each_step = bool(request.params.stop)  # stop strings are matched as text arrives
        n = len(request.completions)
        texts, ids, logprobs, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        prompt_logprobs, last = None, None
        async for last in self.follow(request):
            prompt_logprobs = last.prompt_logprobs or prompt_logprobs
            for out in last.outputs:
                texts[out.index].append(out.text)
                ids[out.index].extend(out.token_ids)
                logprobs[out.index].extend(out.logprobs or ())
                reasons[out.index] = out.finish_reason or reasons[out.index]
        wants_logprobs = request.params.logprobs is not None
        completions = tuple(CompletionOutput(i, "".join(texts[i]), tuple(ids[i]), reasons[i],
                                             tuple(logprobs[i]) if wants_logprobs else None) for i in range(n))
        return RequestOutput(request.request_id, request.prompt, tuple(request.prompt_ids), completions, True,
                             prompt_logprobs)
