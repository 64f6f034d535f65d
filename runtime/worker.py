"""Worker: the step loop in its own thread, fed by a command queue, reporting once per step.

The event loop never runs model code, and the worker never waits on a consumer: it hands
each step's tokens over with one thread-safe call and moves on.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Callable, NamedTuple

from nanoinfer.sampling import SamplingParams
from runtime.engine_core import EngineCore
from runtime.outputs import TokenLogprob
from runtime.sequence import Sequence


class Submit(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


class Abort(NamedTuple):
    request_id: str
    reason: str = "abort"
    index: int | None = None  # one completion of the request; None = all of them


class _Stop(NamedTuple):
    pass


class TokenEvent(NamedTuple):
    """What one completion of a request got in one step."""

    request_id: str
    index: int
    token_id: int
    finish_reason: str | None  # set on the completion's last token
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple | None = None


class StepReport(NamedTuple):
    """Delivered to the event loop after every step (or failure)."""

    events: tuple[TokenEvent, ...]
    stats: dict
    failed: tuple[str, ...] = ()  # request ids that an exception ended
    error: BaseException | None = None


class Worker:
    def __init__(self, core: EngineCore, deliver: Callable[[StepReport], None]):
        """`deliver` is called from the worker thread; it must only hand the report over
        (e.g. loop.call_soon_threadsafe)."""
        self.core = core
        self.deliver = deliver
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.seqs: dict[str, list[Sequence]] = {}  # request id -> its n completions
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nanoinfer-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self.commands.put(_Stop())
        self._thread.join(timeout)

    def submit(self, command: Submit | Abort) -> None:
        self.commands.put(command)

    def _run(self) -> None:
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
            for command in commands:
                if isinstance(command, _Stop):
                    return
                self._handle(command)
            if self.core.has_unfinished():
                self._step()
            elif commands:
                self.deliver(StepReport((), self.core.stats()))

    def _handle(self, command: Submit | Abort) -> None:
        if isinstance(command, Submit):
            try:
                seq = self.core.add_request(command.prompt_token_ids, command.params, request_id=command.request_id,
                                            priority=command.priority)
                self.seqs[command.request_id] = [seq, *seq.forks]
            except Exception as exc:  # validated already on the loop side; never lose the request silently
                self.deliver(StepReport((), self.core.stats(), (command.request_id,), exc))
        else:
            seqs = self.seqs.get(command.request_id, [])
            for seq in seqs:
                if command.index is None or seq.index == command.index:
                    self.core.abort(seq, command.reason)
            if all(seq.is_finished for seq in seqs):
                self.seqs.pop(command.request_id, None)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:
            # Fail everything in flight with the error rather than leave consumers hanging.
            traceback.print_exc()
            self.error = exc
            failed = tuple(self.seqs)
            for seqs in self.seqs.values():
                for seq in seqs:
                    self.core.abort(seq, "abort")
            self.seqs.clear()
            self.deliver(StepReport((), self.core.stats(), failed, exc))
            return
        events = []
        for out in outputs:
            rid = out.seq.request_id
            reason = out.seq.finish_reason if out.finished else None
            events.append(TokenEvent(rid, out.seq.index, out.token_id, reason, out.logprob, out.prompt_logprobs))
            if out.finished and all(seq.is_finished for seq in self.seqs.get(rid, ())):
                self.seqs.pop(rid, None)
        self.deliver(StepReport(tuple(events), self.core.stats()))
