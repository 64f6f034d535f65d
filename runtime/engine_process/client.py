"""ReplicaClient: the front's side of one data-parallel replica — its process, its socket, its requests in flight.

The replica is `python -m runtime.engine_process.replica` (runtime/engine_process/replica.py), started as a tensor-parallel rank is
(runtime/executor/tp_processes.py: our module whatever the user's program is, its arguments on stdin, the weights
shared by handle, its output echoed and its last lines kept). A client is a RequestBook (runtime/request_book.py)
whose commands go over the socket instead of to a worker thread: a reader thread takes the replica's reports and
posts each to the event loop, where they reach their consumers as one AsyncEngine's do. Grammar compiles are
answered on the reader thread itself (a caller may block on one: the loop need not run).

A replica whose process ends (a crash, a kill, the OOM killer) is reported at once (its socket closes): its
requests fail with ReplicaLost naming it, its exit code and its last output; it takes nothing new.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import multiprocessing
import pickle
import socket
import struct
import queue
import subprocess
import threading
import time
from typing import Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from runtime.engine_process import messages as msg
from runtime.engine.llm_engine import EngineError
from runtime.engine.request_state import RequestState
from runtime.executor.tp_processes import RankProcess, _environment, _python
from runtime.loop_inbox import LoopInbox
from runtime.request_book import RequestBook, RequestHandle
from runtime.worker import Abort, Submit

EXIT_WAIT = 5.0  # seconds for a replica whose socket closed to be seen exiting (before it is killed)


class ReplicaLost(EngineError):
    """A data-parallel replica's process ended: its requests failed; the message says which replicas serve on."""


class ReplicaProcess(RankProcess):
    label = "dp replica"


def spawn(args: msg.ReplicaArgs) -> tuple[ReplicaProcess, list[Connection]]:
    """Start replica `args.index`'s process and hand it `args` (as tp_processes hands a rank its own); our ends of
    its sockets, one per front (`args.fronts`: this process's first, then the other API servers')."""
    pairs = [socket.socketpair() for _ in range(args.fronts)]
    try:
        fds = [theirs.fileno() for _, theirs in pairs]
        process = ReplicaProcess(args.index, [*_python(), "-m", "runtime.engine_process.replica", *map(str, fds)],
                                 _environment(), pass_fds=tuple(fds))
    except BaseException:
        for ours, _ in pairs:
            ours.close()
        raise
    finally:
        for _, theirs in pairs:
            theirs.close()
    authkey = bytes(multiprocessing.current_process().authkey)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(args)
    data = struct.pack("<I", len(authkey)) + authkey + buf.getvalue()
    threading.Thread(target=process.send, args=(data,), daemon=True,
                     name=f"nanoinfer-dp-replica{args.index}-send").start()
    return process, [Connection(ours.detach()) for ours, _ in pairs]


class EngineElsewhere:
    """An engine process as an API server other than the first sees it (`serve --api-server-count N`): not its
    child — the first API server started it, watches it and stops it — so there is no exit code, output or
    process to kill here; its socket's end is what this front knows."""

    class _NotOurs:
        def kill(self) -> None:
            pass

        def wait(self, timeout: float | None = None) -> None:
            pass

    proc = _NotOurs()
    killed = False

    def __init__(self, index: int):
        self.rank = index

    def exit_code(self) -> int | None:
        return None

    def exit_and_tail(self) -> tuple[str, str]:
        return "its socket closed", "the first API server's output has its own"


class ReplicaLink:
    """The front's line to one replica process: its socket's writer thread (the event loop never blocks on a
    process that stopped reading: a hung engine's buffer fills) and reader thread (its messages handed on; beats
    checked: silent for msg.SILENCE seconds, or a step longer than `step_timeout`, and it is killed as hung), and
    its grammar compiles in flight."""

    def __init__(self, index: int, process: ReplicaProcess | EngineElsewhere, conn: Connection, step_timeout: float):
        self.index, self.process, self.conn, self.step_timeout = index, process, conn, step_timeout
        self._keys = itertools.count()
        self._compiles: dict[int, Future] = {}  # by key, until the replica answers
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False  # told to stop: its end is no loss
        self.gone: BaseException | None = None  # why it ended (set by the reader): nothing answers now

    def start(self, on_message, on_end) -> None:
        """Hand each message to `on_message` and, at the process's end (not a stop), why (`killed`: a reason the
        front killed it, or None) to `on_end`, which returns the error its compiles fail with; both on the
        reader thread."""
        threading.Thread(target=self._read, args=(on_message, on_end), daemon=True,
                         name=f"nanoinfer-dp-replica{self.index}-read").start()
        threading.Thread(target=self._write, daemon=True, name=f"nanoinfer-dp-replica{self.index}-write").start()

    def post(self, message) -> None:
        """Send `message` (runtime/engine_process/messages.py) on the writer thread; lost with the replica if it is gone."""
        self._outbox.put(message)

    def compile(self, spec, gone: BaseException) -> Future:
        """The grammar compiled in the replica: a future of None, or of the RequestError naming what is wrong
        (`gone`: its error if the replica is gone by then)."""
        key, future = next(self._keys), Future()
        self._compiles[key] = future
        self.post(msg.Compile(key, spec))
        if self.gone is not None and self._compiles.pop(key, None) is not None:  # (no answer will come)
            future.set_exception(self.gone or gone)
        return future

    def stop(self) -> None:
        """Tell the replica to stop (it finishes its step, closes its engine and exits)."""
        self.stopping = True
        self.post(msg.Stop())
        self._outbox.put(None)

    def _write(self) -> None:
        """Send what is posted; what came meanwhile goes as one list (a burst of requests admitted in one loop
        iteration: one pickle and one write for all, and the replica reads them at once)."""
        end = False
        while not end:
            batch = [self._outbox.get()]
            while not self._outbox.empty() and batch[-1] is not None:
                batch.append(self._outbox.get())
            if batch[-1] is None:
                batch.pop()
                end = True
            try:
                if batch:
                    self.conn.send(batch[0] if len(batch) == 1 else batch)
            except (OSError, ValueError):  # (the replica is gone: its reader reports that)
                return

    def _read(self, on_message, on_end) -> None:
        killed = None
        try:
            killed = self._receive(on_message)
        except Exception as exc:  # noqa: BLE001 - a message it cannot read: the replica cannot be followed
            killed = f"it sent what its front cannot read ({exc!r})"
        self._outbox.put(None)
        if self.stopping:
            self.gone = EngineError(f"replica {self.index} was stopped")
            return
        if killed is not None:
            self.process.proc.kill()
        try:
            self.process.proc.wait(EXIT_WAIT)
        except subprocess.TimeoutExpired:  # (its socket closed, yet it runs: it cannot serve)
            self.process.proc.kill()
            self.process.proc.wait()
        self.gone = error = on_end(killed)
        for key in list(self._compiles):
            future = self._compiles.pop(key, None)
            if future is not None:
                future.set_exception(error)

    def _receive(self, on_message) -> str | None:
        """Messages until the socket's end (None), or why the replica counts as hung."""
        while True:
            if not self.conn.poll(msg.SILENCE):
                if self.stopping or self.process.exit_code() is not None:
                    continue  # (its end is on its way)
                return f"it said nothing for {msg.SILENCE:g} s"
            try:
                message = msg.unframe(self.conn.recv_bytes())
            except (EOFError, OSError):
                return None
            if isinstance(message, msg.Beat):
                if message.busy_since is not None and time.monotonic() - message.busy_since > self.step_timeout:
                    return f"a step ran for more than {self.step_timeout:g} s"
            elif isinstance(message, msg.Compiled):
                future = self._compiles.pop(message.key, None)
                if future is not None:
                    future.set_exception(message.error) if message.error is not None else future.set_result(None)
            else:
                on_message(message)


class ReplicaClient(RequestBook):
    """Replica `index`: requests booked here run in its process (reached through its ReplicaLink)."""

    def __init__(self, index: int, process: ReplicaProcess | EngineElsewhere, conn: Connection,
                 group: Sequence[ReplicaClient] = (), alone: bool = False, step_timeout: float = 600.0):
        """`group`: the front's replicas, this one among them (a lost one's error names those serving on).
        `alone`: the front's one engine process (a server's engine apart from its HTTP front), not a replica
        among others; errors name it so. `step_timeout`: seconds a step may run before the process counts as
        hung (killed, as one that died)."""
        super().__init__()
        self.index, self.process, self.conn = index, process, conn
        self.front_conns: list[Connection] = []  # our ends of its other fronts' sockets, until handed to them
        self.link = ReplicaLink(index, process, conn, step_timeout)
        self.name = "the engine process" if alone else f"data-parallel replica {index}"
        self.ready: msg.Ready | None = None
        self._keys = itertools.count()
        # The front's state of each request the replica runs (it files the replica's progress, detokenizes and
        # matches stop strings), by key, and each one's key, until retired here.
        self._states: dict[int, RequestState] = {}
        self._key_of: dict[int, int] = {}  # id(state) -> key
        self._stats: dict = {}
        self._fatal: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._group = group

    def wait_ready(self) -> msg.Ready:
        """Until the replica has built its engine (loading a checkpoint may take minutes); the error that stopped
        it building one, or ReplicaLost (its exit code and last output) if it exits first."""
        while True:
            if self.conn.poll(0.1):
                try:
                    message = msg.unframe(self.conn.recv_bytes())
                except (EOFError, OSError):
                    self.process.proc.wait(EXIT_WAIT)
                    raise self.lost(starting=True)
                if isinstance(message, msg.Failed):  # (a bad checkpoint: its own error, as one engine raises it)
                    raise message.error
                self.ready, self._stats = message, message.stats
                return message
            if self.process.exit_code() is not None:
                raise self.lost(starting=True)

    def lost(self, starting: bool = False, killed: str | None = None) -> ReplicaLost:
        """The error that reports this (exited) replica: its exit code and its output's last lines (and why the
        front `killed` it, if it did)."""
        how, last = self.process.exit_and_tail()
        how = f"{killed}: killed, {how}" if killed else how
        if starting:
            return ReplicaLost(f"{self.name} exited while starting ({how}); {last}")
        # (a peer dying at the same time may not be marked unhealthy yet: its process has exited, though)
        peers = [r for r in self._group if r is not self]
        serving = [p.index for p in peers if p.healthy and p.process.exit_code() is None]
        left = (f"replica {', '.join(map(str, serving))} serves on" if len(serving) == 1 else
                f"replicas {', '.join(map(str, serving))} serve on" if serving else
                "no replica is left to serve (restart the server)")
        if not peers:  # (alone: nothing serves on, and the server says so at /health)
            return ReplicaLost(f"{self.name} exited ({how}): its requests failed (restart the server); {last}")
        return ReplicaLost(f"{self.name} exited ({how}): its requests failed, {left}; {last}")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._send = loop, self._command
        self.link.start(LoopInbox(loop, self._on_report).put, self._ended)

    @property
    def healthy(self) -> bool:
        return self._fatal is None

    def stats(self) -> dict:
        """The replica's counts at its last report, and healthy (with `error`, why not)."""
        down = {} if self._fatal is None else {"error": str(self._fatal)}
        return {**self._stats, "healthy": self.healthy, **down}

    # -- to the replica ----------------------------------------------------------------------------

    def enqueue(self, state: RequestState) -> RequestHandle:
        """Book a request checked by the front (`state`, whose tokenizer detokenizes its outputs here) and send
        it to the replica."""
        key = next(self._keys)
        self._states[key], self._key_of[id(state)] = state, key
        return self._add(state)

    def _command(self, command: Submit | Abort) -> None:
        """The RequestBook's commands, as the replica reads them."""
        state: RequestState = command.request
        key = self._key_of.get(id(state))
        if key is None:
            return  # (retired here already)
        if isinstance(command, Abort):
            self.link.post(msg.Abort(key))
        else:
            self.link.post(msg.Submit(key, state.request_id, state.prompt_ids, state.params, state.priority))

    def compile(self, spec) -> Future:
        """The grammar compiled in the replica: a future of None, or of the RequestError naming what is wrong."""
        return self.link.compile(spec, self._fatal or ReplicaLost(f"{self.name} is gone"))

    # -- from the replica --------------------------------------------------------------------------

    def _ended(self, killed: str | None) -> ReplicaLost:
        """On the reader thread, at the process's end: its error, and every request of it failed on the loop."""
        error = self.lost(killed=killed)
        _call_soon(self._loop, self._on_lost, error)
        return error

    def _on_report(self, steps: list[msg.Step]) -> None:
        """On the loop, with the steps reported since the last call: the counts, the engine's health, each
        request's progress filed into its state and what is new handed to its consumer as one output (a front
        behind its engine takes several steps at once: one chunk for their tokens); a stop string matched here
        ends that completion in the replica too. A request whose outputs cannot be made fails alone; an engine
        that died fails what it had."""
        self._stats = steps[-1].stats
        fatal = next((step.fatal for step in steps if step.fatal is not None), None)
        if fatal is not None and self._fatal is None:
            self._fatal = pickle.loads(fatal)
        now, states, touched = time.monotonic(), self._states, {}
        for step in steps:
            for advance in step.advances:
                state = states.get(advance.key)
                if state is not None:  # (else aborted here: its progress was on its way)
                    touched[advance.key] = state
                    try:
                        # (an Advance has a Progress's fields: only a failure's pickled error needs making one)
                        state.file(advance if advance.error is None else advance.progress(), now)
                    except Exception as exc:  # noqa: BLE001 - this request's own failure
                        self._fail(advance.key, state, exc)
        outputs = []
        for key, state in touched.items():
            try:
                out = state.take()
            except Exception as exc:  # noqa: BLE001 - this request's own failure (its text could not be made)
                self._fail(key, state, exc)
                out = state.take()  # (its failure: no text made)
            if state.stopped:
                for index in state.stopped:
                    self.link.post(msg.Abort(key, index, "stop"))
                state.stopped.clear()
            if out is not None:
                outputs.append((state, out))
        self._deliver(outputs)
        if self._fatal is not None and fatal is not None:
            self.abort_all(self._fatal)  # (those it failed have their error already; the rest end with it now)

    def _fail(self, key: int, state: RequestState, exc: Exception) -> None:
        """`state`'s request failed here, in the front (its next take() says so): the replica stops it."""
        from runtime.engine.faults import RequestFailed

        self.link.post(msg.Abort(key))
        state.end("error", RequestFailed.because("its outputs could not be made", exc))

    def _on_lost(self, error: ReplicaLost) -> None:
        """On the loop: every request of the replica fails with `error`; nothing new comes here."""
        if self._fatal is None or not isinstance(self._fatal, ReplicaLost):
            self._fatal = error
        self.abort_all(error)
        self._send = None

    def _retire(self, request: RequestHandle) -> None:
        super()._retire(request)
        key = self._key_of.pop(id(request.state), None)
        self._states.pop(key, None)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is left to tell
        pass
