"""Worker: AsyncEngine's step loop in its own thread, fed by a command queue, reporting once per step.

It runs `LLMEngine.step` — the same step `LLM` runs on the caller's thread. The event loop
never runs model code, and the worker never waits on a consumer: it hands each step's outputs
over with one thread-safe call and moves on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, NamedTuple, Protocol

import torch

from runtime.engine.llm_engine import LLMEngine
from runtime.engine.request_state import RequestState

log = logging.getLogger("nanoinfer.engine")


class Submit(NamedTuple):
    request: RequestState  # checked on the caller's side (LLMEngine.new_request)


class Abort(NamedTuple):
    request: RequestState
    index: int | None = None  # one completion (a stop string its front matched), else the whole request
    reason: str = "abort"


class _Stop(NamedTuple):
    pass


class StepReport(NamedTuple):
    """Delivered to the event loop after every step or command."""

    outputs: tuple  # what the worker's Outputs make: (RequestState, RequestOutput) pairs by default
    stats: dict
    fatal: BaseException | None = None  # the engine is dead: every request was failed with this


class Outputs(Protocol):
    """What a worker reports of each step, of a request it refuses, and of every request when the engine dies."""

    def step(self, engine: LLMEngine) -> list: ...

    def refused(self, state: RequestState, error: BaseException) -> list: ...

    def failed(self, engine: LLMEngine, error: BaseException) -> list: ...


class RequestOutputs:
    """AsyncEngine's: each request's RequestOutput (its text detokenized here), with its state."""

    def step(self, engine: LLMEngine) -> list:
        return engine.step_requests()

    def refused(self, state: RequestState, error: BaseException) -> list:
        state.end("error", error)
        return [(state, state.take())]

    def failed(self, engine: LLMEngine, error: BaseException) -> list:
        outputs = engine.core.fail_all(error)
        for out in outputs:
            out.seq.request.end("error", error)
        states = {id(out.seq.request): out.seq.request for out in outputs}.values()
        return [(s, o) for s in states if (o := s.take()) is not None]


class Worker:
    def __init__(self, engine: LLMEngine, deliver: Callable[[StepReport], None], outputs: Outputs = RequestOutputs()):
        """`deliver` is called from the worker thread; it must only hand the report over
        (e.g. loop.call_soon_threadsafe). `outputs`: what its reports carry."""
        self.engine = engine
        self.deliver = deliver
        self.outputs = outputs
        self.busy_since: float | None = None  # time.monotonic() the step running now began (None: between steps)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="nanoinfer-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.commands.put(_Stop())
        self._thread.join(timeout)

    def submit(self, command: Submit | Abort) -> None:
        self.commands.put(command)

    def _run(self) -> None:
        engine = self.engine
        device = engine.model.params.device
        if device.type == "cuda":  # (a new thread's current device is cuda:0, where streams and kernels would go)
            torch.cuda.set_device(device)
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - a bug in the loop itself: fail loudly, never hang
            log.exception("the engine's step loop failed; the engine is dead")
            engine.fatal = exc
            try:
                results = tuple(self.outputs.failed(engine, exc))
            except Exception:  # noqa: BLE001 - the books are beyond repair: report nothing more
                results = ()
            self.deliver(StepReport(results, engine.core.stats(), exc))
            self._refuse_until_stopped()

    def _refuse_until_stopped(self) -> None:
        """After a fatal error: fail every new request at once, until stop()."""
        while not isinstance(command := self.commands.get(), _Stop):
            if isinstance(command, Submit):
                self.deliver(StepReport(tuple(self._refused(command.request)), self.engine.core.stats(),
                                        self.engine.fatal))

    def _refused(self, state: RequestState, error: BaseException | None = None) -> list:
        return self.outputs.refused(state, error or self.engine.fatal)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            # Block for a command only when there is nothing to compute.
            block = not engine.has_unfinished_requests()
            try:
                commands = [self.commands.get(block=block)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            refused = []
            for command in commands:
                if isinstance(command, _Stop):
                    return
                if isinstance(command, Abort) and command.index is not None:
                    engine.core.abort_request(command.request, command.reason, command.index)
                elif isinstance(command, Abort):
                    engine.abort(command.request, command.reason)
                elif engine.fatal is not None:
                    refused += self._refused(command.request)
                else:
                    try:
                        engine.add(command.request)
                    except Exception as exc:  # noqa: BLE001 - checked on the caller's side already; never lose it
                        refused += self._refused(command.request, exc)
            if engine.has_unfinished_requests() and engine.fatal is None:
                self.busy_since = time.monotonic()
                outputs = self.outputs.step(engine)
                self.busy_since = None
                self.deliver(StepReport(tuple(refused + outputs), engine.stats(), engine.fatal))
            elif commands:
                self.deliver(StepReport(tuple(refused), engine.stats(), engine.fatal))
