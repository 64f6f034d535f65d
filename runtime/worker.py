"""Worker: the step loop in its own thread, fed by a command queue, reporting once per step.

The event loop never runs model code, and the worker never waits on a consumer: it hands
each step's tokens over with one thread-safe call and moves on. It keeps no books of its
own: requests are known to the engine core by the key they were submitted with.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Hashable, NamedTuple

from nanoinfer.sampling import SamplingParams
from runtime.engine_core import EngineCore, EngineDead, TokenOutput
from runtime.faults import RequestFailed
from runtime.outputs import TokenLogprob

log = logging.getLogger("nanoinfer.engine")


class Submit(NamedTuple):
    request: Hashable  # the key every event about this request carries
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


class Abort(NamedTuple):
    request: Hashable
    reason: str = "abort"
    index: int | None = None  # one completion of the request; None = all of them


class _Stop(NamedTuple):
    pass


class TokenEvent(NamedTuple):
    """What one completion of a request got in one step: a token, or its end."""

    request: Hashable
    index: int
    token_id: int | None  # None when the engine failed the request (see `error`)
    finish_reason: str | None  # set on the completion's last event
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple | None = None
    error: Exception | None = None  # why the engine failed this request
    scheduled_at: float | None = None  # time.monotonic() when the request first got a step
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the request started


class StepReport(NamedTuple):
    """Delivered to the event loop after every step."""

    events: tuple[TokenEvent, ...]
    stats: dict
    fatal: BaseException | None = None  # the engine is dead: every request was failed with this


def _event(out: TokenOutput) -> TokenEvent:
    seq = out.seq
    return TokenEvent(seq.request, seq.index, out.token_id, seq.finish_reason if out.finished else None, out.logprob,
                      out.prompt_logprobs, seq.error, seq.scheduled_at, seq.num_cached_tokens)


class Worker:
    def __init__(self, core: EngineCore, deliver: Callable[[StepReport], None]):
        """`deliver` is called from the worker thread; it must only hand the report over
        (e.g. loop.call_soon_threadsafe)."""
        self.core = core
        self.deliver = deliver
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nanoinfer-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.commands.put(_Stop())
        self._thread.join(timeout)

    def submit(self, command: Submit | Abort) -> None:
        self.commands.put(command)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - a bug in the loop itself: fail loudly, never hang
            log.exception("the engine's step loop failed; the engine is dead")
            self.fatal = exc
            try:
                events = [_event(out) for out in self.core.fail_all(exc)]
            except Exception:  # noqa: BLE001 - the books are beyond repair: report nothing more
                events = []
            self.deliver(StepReport(tuple(events), self.core.stats(), exc))
            self._refuse_until_stopped()

    def _refuse_until_stopped(self) -> None:
        """After a fatal error: fail every new request at once, until stop()."""
        while not isinstance(command := self.commands.get(), _Stop):
            if isinstance(command, Submit):
                self.deliver(StepReport((TokenEvent(command.request, 0, None, "error", error=self.fatal),),
                                        self.core.stats(), self.fatal))

    def _loop(self) -> None:
        while True:
            # Block for a command only when there is nothing to compute.
            block = not self.core.has_unfinished()
            try:
                commands = [self.commands.get(block=block)]
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            events = []
            for command in commands:
                if isinstance(command, _Stop):
                    return
                events += self._handle(command)
            if self.core.has_unfinished() and self.fatal is None:
                self._step(events)
            elif commands:
                self.deliver(StepReport(tuple(events), self.core.stats(), self.fatal))

    def _handle(self, command: Submit | Abort) -> list[TokenEvent]:
        if isinstance(command, Abort):
            self.core.abort_request(command.request, command.reason, command.index)
            return []
        if self.fatal is not None:
            return [TokenEvent(command.request, 0, None, "error", error=self.fatal)]
        try:
            self.core.add_request(command.prompt_token_ids, command.params, request=command.request,
                                  priority=command.priority)
        except Exception as exc:  # noqa: BLE001 - checked on the loop side already; never lose it silently
            return [TokenEvent(command.request, 0, None, "error", error=exc)]
        return []

    def _step(self, events: list[TokenEvent]) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:  # noqa: BLE001 - the core contains what it can; this it could not
            log.exception("the engine step failed; failing every request in flight")
            outputs = self.core.fail_all(exc if isinstance(exc, EngineDead) else self._unplaced(exc))
            # A dead device, or books that no longer balance, cannot serve anything again.
            if isinstance(exc, EngineDead) or self.core.blocks.num_free_blocks != self.core.blocks.num_blocks:
                self.fatal = exc
        events += [_event(out) for out in outputs]
        self.deliver(StepReport(tuple(events), self.core.stats(), self.fatal))

    @staticmethod
    def _unplaced(exc: Exception) -> RequestFailed:
        return RequestFailed.because("the engine step failed outside any one request", exc)
