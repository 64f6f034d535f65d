"""A data-parallel replica's process: `python -m runtime.dp_replica FD` — one engine, fed by the front over a socket.

The front (runtime/data_parallel.py) starts one per replica, whatever the user's program is (a notebook,
`python -`, a script without a main guard: nothing of it runs here). Its arguments (runtime/dp_messages.py's
ReplicaArgs: the weights shared by handle, or a checkpoint to load) come on stdin as a tensor-parallel rank's do
(runtime/executor/tp_rank.py); FD is its end of a socket pair with the front. Here the engine runs as in
AsyncEngine: the step loop on a Worker thread (runtime/worker.py), commands read on the main thread. With
tensor_parallel_size > 1 this process is its group's rank 0 and starts the other ranks itself: each replica has
its own default process group, its own process.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import torch

from runtime import dp_messages as msg
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import Progress
from runtime.engine.request_state import RequestState
from runtime.worker import Abort, StepReport, Submit, Worker


def build(args: msg.ReplicaArgs) -> LLMEngine:
    """The replica's engine over the front's weights (copied to this replica's device, where they are not on it),
    or over the checkpoint loaded here."""
    from nanoinfer.loaders import load_model
    from nanoinfer.model import map_params

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
    """One engine behind the front's socket: commands in (main thread), reports out (a sender thread, the worker's
    reports and, while none comes, a Beat a second: the front knows a silent process from a busy one)."""

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine, self.conn = engine, conn
        self._send_lock = threading.Lock()  # (the sender, the grammar compiler and the main thread all send)
        # By the front's key, until every completion of it has ended: its state here, its unfinished completions.
        # (The main thread adds and aborts, the sender forgets what ended: under the lock.)
        self._states: dict[int, tuple[RequestState, set[int]]] = {}
        self._states_lock = threading.Lock()
        # The worker hands each report over and steps on; this thread encodes and sends it (while the step
        # waits for the device, which releases the interpreter's lock).
        self._reports: queue.SimpleQueue[StepReport | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_reports, daemon=True, name="nanoinfer-dp-send")
        self.worker = Worker(engine, self._reports.put, StepTokens())

    def send(self, message) -> None:
        data = msg.frame(message)
        with self._send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the front is gone: the main thread's read ends this process
                pass

    def run(self) -> None:
        """Serve commands until Stop, or until the front's end closes."""
        model = dataclasses.replace(self.engine.model, params=None)
        self.send(msg.Ready(model, self.engine.core.limits, self.engine.stats()))
        self._sender.start()
        self.worker.start()
        try:
            while True:
                try:
                    command = self.conn.recv()
                except (EOFError, OSError):
                    return
                if isinstance(command, msg.Stop):
                    return
                self._command(command)
        finally:
            self.worker.stop()
            self._reports.put(None)
            self._sender.join()
            self.engine.close()

    def _command(self, command) -> None:
        if isinstance(command, msg.Submit):
            # (no tokenizer: the front detokenizes; this state only names the request to the core)
            state = RequestState(command.request_id, None, command.prompt_ids, command.params, None,
                                 priority=command.priority)
            state.owner = command.key
            with self._states_lock:
                self._states[command.key] = (state, set(range(command.params.n)))
            self.worker.submit(Submit(state))
        elif isinstance(command, msg.Abort):
            with self._states_lock:
                entry = self._states.get(command.key)
            if entry is not None:
                self._ended(command.key, command.index)
                self.worker.submit(Abort(entry[0], command.index, command.reason))
        elif isinstance(command, msg.Compile):
            self._compile(command)
        elif isinstance(command, msg.PrepareGrammars):
            self.engine.core.executor.grammars.prepare()
        else:
            raise TypeError(f"unknown command from the front: {command!r}")

    def _compile(self, command: msg.Compile) -> None:
        """The grammar compiled here (and cached: the request that asks for it finds it); its error, if any, back."""
        try:
            future = self.engine.core.executor.grammars.compile(command.spec)
        except Exception as exc:  # noqa: BLE001 - a bad grammar is the request's, never this process's end
            self.send(msg.Compiled(command.key, msg.portable(exc)))
            return
        future.add_done_callback(lambda f: self.send(msg.Compiled(command.key, msg.portable(f.exception()))))

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
        """The step's progress as one message."""
        for advance in report.outputs:
            if advance.finished:
                self._ended(advance.key, advance.index)
        fatal = None if report.fatal is None else msg.pickled(report.fatal)
        self.send(msg.Step(list(report.outputs), report.stats, fatal))

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
    conn = Connection(int(argv[0]))
    args: msg.ReplicaArgs = read_arguments(sys.stdin.buffer)
    try:
        engine = build(args)
    except Exception as exc:
        conn.send_bytes(msg.frame(msg.Failed(msg.portable(exc))))
        from nanoinfer.errors import NanoInferError

        if isinstance(exc, NanoInferError):  # (a bad checkpoint or setting: the front raises it, once)
            sys.exit(1)
        raise  # (a bug: its traceback in the replica's output, exit code 1)
    Replica(engine, conn).run()
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
