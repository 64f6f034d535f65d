"""A data-parallel replica's process: `python -m runtime.engine_process.replica FD` — one engine, fed by the front over a socket.

The front (runtime/engine_process/data_parallel.py) starts one per replica, whatever the user's program is (a notebook,
`python -`, a script without a main guard: nothing of it runs here). Its arguments (runtime/engine_process/messages.py's
ReplicaArgs: the weights shared by handle, or a checkpoint to load) come on stdin as a tensor-parallel rank's do
(runtime/executor/tp_rank.py); FD is its end of a socket pair with the front (FD... with a server's N API server
processes, one each: `serve --api-server-count N`; the first is the one that started it). Here the engine runs as in
AsyncEngine: the step loop on a Worker thread (runtime/worker.py), commands read on the main thread. With
tensor_parallel_size > 1 this process is its group's rank 0 and starts the other ranks itself: each replica has
its own default process group, its own process.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait

import torch

from runtime.engine_process import messages as msg
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import Progress
from runtime.engine.request_state import RequestState
from runtime.worker import Abort, StepReport, Submit, Worker


OUTBOX = 4096  # messages waiting for a front other than the first before it counts as hung


def build(args: msg.ReplicaArgs) -> LLMEngine:
    """The replica's engine over the front's weights (copied to this replica's device, where they are not on it),
    or over the checkpoint loaded here."""
    from nanoinfer.loaders import load_model
    from nanoinfer.model.decoder import map_params

    device = torch.device(args.device)
    if device.type == "cuda":  # (streams, graphs and kernels are made on the current device)
        torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is not None:
        model = args.model
        if model.params.device != device:
            model = dataclasses.replace(model, params=map_params(lambda t: t.to(device), model.params))
    else:
        model = load_model(args.path, dataclasses.replace(args.load, device=str(device), progress=False))
    engine = LLMEngine(model, args.config)
    if args.setup:
        module, _, name = args.setup.partition(":")
        getattr(importlib.import_module(module), name)(args.index, engine)
    return engine


class StepTokens:
    """The worker's Outputs here (runtime/worker.py): each step's progress as the Advances its front files, made on
    the worker's thread (the sequences change under the next step); a refused request's end per completion."""

    def step(self, engine: LLMEngine) -> list:
        return [msg.Advance.of(out.seq.request.owner, Progress.of(out)) for out in engine.step_tokens()]

    def refused(self, state: RequestState, error: BaseException) -> list:
        failed = msg.pickled(error)
        return [msg.Advance(state.owner, i, None, True, "error", error=failed) for i in range(state.params.n)]

    def failed(self, engine: LLMEngine, error: BaseException) -> list:
        return [msg.Advance.of(out.seq.request.owner, Progress.of(out)) for out in engine.core.fail_all(error)]


class Replica:
    """One engine behind its fronts' sockets: commands in (main thread), reports out (a sender thread, the worker's
    reports and, while none comes, a Beat a second: a front knows a silent process from a busy one).

    With several fronts (API server processes), each request is known here by its front's key times the number of
    fronts plus the front's index, and each step's progress goes to each front as a Step of its own requests. The
    first front stops this process; another one that goes away has its requests aborted."""

    def __init__(self, engine: LLMEngine, conns: list[Connection]):
        self.engine, self.conns = engine, conns
        self._send_lock = threading.Lock()  # (the sender, the grammar compiler and the main thread all send)
        # The other fronts' messages go through a writer thread each: one that reads slowly (an API server still
        # starting, when this sends Ready) never holds up the first's; one that reads nothing for OUTBOX messages
        # is hung, and dropped.
        self._outboxes: list[queue.Queue | None] = [None] + [queue.Queue(OUTBOX) for _ in conns[1:]]
        self._dropped: set[int] = set()
        self._counts_sent = [0.0] * len(conns)  # time.monotonic() of each front's last Step
        # By key, until every completion of it has ended: its state here, its unfinished completions.
        # (The main thread adds and aborts, the sender forgets what ended: under the lock.)
        self._states: dict[int, tuple[RequestState, set[int]]] = {}
        self._states_lock = threading.Lock()
        # The worker hands each report over and steps on; this thread encodes and sends it (while the step
        # waits for the device, which releases the interpreter's lock).
        self._reports: queue.SimpleQueue[StepReport | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_reports, daemon=True, name="nanoinfer-dp-send")
        self.worker = Worker(engine, self._reports.put, StepTokens())

    def send(self, message, front: int | None = None) -> None:
        """`message` to front `front`, or to every front."""
        data = msg.frame(message)
        for i in range(len(self.conns)) if front is None else (front,):
            if i == 0:
                with self._send_lock:
                    try:
                        self.conns[0].send_bytes(data)
                    except OSError:  # the front is gone: the main thread's read ends this process
                        pass
            elif i not in self._dropped:
                try:
                    self._outboxes[i].put_nowait(data)
                except queue.Full:  # (it reads nothing: hung, or stopped)
                    self._drop(i)

    def _drop(self, front: int) -> None:
        """Front `front` (not the first) is hung: its requests are aborted and its socket shut, so that it sees the
        end (and exits: runtime/serve/api_servers.py) and this process's read of it ends too."""
        self._dropped.add(front)
        self._front_gone(front)
        try:
            with socket.socket(fileno=os.dup(self.conns[front].fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # (gone already)
            pass

    def _write(self, front: int) -> None:
        outbox, conn = self._outboxes[front], self.conns[front]
        while (data := outbox.get()) is not None:
            try:
                conn.send_bytes(data)
            except OSError:  # (that front is gone: the main thread's read sees it)
                return

    def run(self) -> None:
        """Serve commands until Stop, or until the first front's end closes."""
        for front in range(1, len(self.conns)):
            threading.Thread(target=self._write, args=(front,), daemon=True, name=f"nanoinfer-front{front}-send").start()
        model = dataclasses.replace(self.engine.model, params=None)
        self.send(msg.Ready(model, self.engine.core.limits, self.engine.stats()))
        self._sender.start()
        self.worker.start()
        live = {conn: i for i, conn in enumerate(self.conns)}
        try:
            while True:
                for conn in wait(list(live)):
                    front = live[conn]
                    try:
                        commands = conn.recv()  # (one, or a list: what the front posted meanwhile)
                    except (EOFError, OSError):
                        commands = [msg.Stop()]
                    for command in commands if isinstance(commands, list) else [commands]:
                        if isinstance(command, msg.Stop) and front == 0:
                            return
                        if isinstance(command, msg.Stop):  # (another API server stopping: its socket is done)
                            del live[conn]
                            self._dropped.add(front)
                            self._front_gone(front)
                            break
                        self._command(command, front)
        finally:
            self.worker.stop()
            self._reports.put(None)
            self._sender.join()
            for outbox in self._outboxes[1:]:
                try:
                    outbox.put_nowait(None)
                except queue.Full:  # (a hung front's writer: a daemon thread, gone with the process)
                    pass
            self.engine.close()

    def _front_gone(self, front: int) -> None:
        """An API server process ended: its requests are aborted (nobody reads them)."""
        fronts = len(self.conns)
        with self._states_lock:
            keys = [key for key in self._states if key % fronts == front]
        for key in keys:
            self._command(msg.Abort(key // fronts), front)

    def _command(self, command, front: int) -> None:
        if isinstance(command, msg.Submit):
            # (no tokenizer: the front detokenizes; this state only names the request to the core)
            key = command.key * len(self.conns) + front
            state = RequestState(command.request_id, None, command.prompt_ids, command.params, None,
                                 priority=command.priority)
            state.owner = key
            with self._states_lock:
                self._states[key] = (state, set(range(command.params.n)))
            self.worker.submit(Submit(state))
        elif isinstance(command, msg.Abort):
            key = command.key * len(self.conns) + front
            with self._states_lock:
                entry = self._states.get(key)
            if entry is not None:
                self._ended(key, command.index)
                self.worker.submit(Abort(entry[0], command.index, command.reason))
        elif isinstance(command, msg.Compile):
            self._compile(command, front)
        elif isinstance(command, msg.PrepareGrammars):
            self.engine.core.executor.grammars.prepare()
        else:
            raise TypeError(f"unknown command from the front: {command!r}")

    def _compile(self, command: msg.Compile, front: int) -> None:
        """The grammar compiled here (and cached: the request that asks for it finds it); its error, if any, back."""
        try:
            future = self.engine.core.executor.grammars.compile(command.spec)
        except Exception as exc:  # noqa: BLE001 - a bad grammar is the request's, never this process's end
            self.send(msg.Compiled(command.key, msg.portable(exc)), front)
            return
        future.add_done_callback(lambda f: self.send(msg.Compiled(command.key, msg.portable(f.exception())), front))

    def _send_reports(self) -> None:
        try:
            while True:
                try:
                    report = self._reports.get(timeout=msg.BEAT_EVERY)
                except queue.Empty:  # (no step ended for a while: say the process lives, and since when it steps)
                    self.send(msg.Beat(self.worker.busy_since))
                    continue
                if report is None:
                    return
                self._report(report)
        except BaseException:  # noqa: BLE001 - a report that cannot go out: no silent stall, the front sees us go
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)

    def _report(self, report: StepReport) -> None:
        """The step's progress as one message to each front (its own requests', by its own keys)."""
        for advance in report.outputs:
            if advance.finished:
                self._ended(advance.key, advance.index)
        fatal = None if report.fatal is None else msg.pickled(report.fatal)
        fronts = len(self.conns)
        if fronts == 1:
            self.send(msg.Step(list(report.outputs), report.stats, fatal))
            return
        per_front: list[list[msg.Advance]] = [[] for _ in range(fronts)]
        for advance in report.outputs:
            advance.key, front = divmod(advance.key, fronts)  # (the front's own key: this Advance is sent only)
            per_front[front].append(advance)
        now = time.monotonic()
        for front, advances in enumerate(per_front):
            # A front with nothing in this step hears the counts twice a second at most: one still starting (the
            # first, before its server runs) is not sent a Step for every step its peers' requests take.
            if advances or fatal is not None or now - self._counts_sent[front] > msg.BEAT_EVERY / 2:
                self._counts_sent[front] = now
                self.send(msg.Step(advances, report.stats, fatal), front)

    def _ended(self, key: int, index: int | None = None) -> None:
        """Completion `index` (or every one) of request `key` has ended here: the request is forgotten with
        its last."""
        with self._states_lock:
            entry = self._states.get(key)
            if entry is not None:
                entry[1].difference_update(range(entry[0].params.n) if index is None else (index,))
                if not entry[1]:
                    del self._states[key]


def main(argv: list[str]) -> None:
    from runtime.executor.tp_rank import exit_with_parent, read_arguments

    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the process group: the front stops us)
    conns = [Connection(int(fd)) for fd in argv]
    args: msg.ReplicaArgs = read_arguments(sys.stdin.buffer)
    try:
        engine = build(args)
    except Exception as exc:
        conns[0].send_bytes(msg.frame(msg.Failed(msg.portable(exc))))
        from nanoinfer.errors import NanoInferError

        if isinstance(exc, NanoInferError):  # (a bad checkpoint or setting: the front raises it, once)
            sys.exit(1)
        raise  # (a bug: its traceback in the replica's output, exit code 1)
    # What the start made (the model's tables, the tokenizer, compiled kernels) lives as long as the process: out
    # of the collector's way, or every full collection walks it while steps wait (as the server's front does).
    gc.freeze()
    Replica(engine, conns).run()
    for conn in conns:
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
