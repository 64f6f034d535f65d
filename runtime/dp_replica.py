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
from multiprocessing.connection import Connection

import torch

from runtime import dp_messages as msg
from runtime.engine.llm_engine import LLMEngine
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


class Replica:
    """One engine behind the front's socket: commands in (main thread), reports out (the worker's thread)."""

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine, self.conn = engine, conn
        self._send_lock = threading.Lock()  # (the worker, the grammar compiler and the main thread all send)
        self._states: dict[int, RequestState] = {}  # by the front's key, until their last output went out
        # The worker hands each report over and steps on; this thread pickles and sends it (while the step
        # waits for the device, which releases the interpreter's lock).
        self._reports: queue.SimpleQueue[StepReport | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_reports, daemon=True, name="nanoinfer-dp-send")
        self.worker = Worker(engine, self._reports.put)

    def send(self, message) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
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
            state = RequestState(command.request_id, command.prompt, command.prompt_ids, command.params,
                                 self.engine.tokenizer, priority=command.priority, stream=command.stream)
            state.owner = command.key
            self._states[command.key] = state
            self.worker.submit(Submit(state))
        elif isinstance(command, msg.Abort):
            state = self._states.pop(command.key, None)
            if state is not None:
                self.worker.submit(Abort(state))
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
        while (report := self._reports.get()) is not None:
            self._report(report)

    def _report(self, report: StepReport) -> None:
        """The step's outputs, without the prompt the front has already."""
        outputs = []
        for state, out in report.outputs:
            timing = None
            if out.finished:
                self._states.pop(state.owner, None)
                timing = msg.Timing(state.scheduled_at, state.first_token_at, state.finished_at,
                                    tuple(state.token_gaps))
            out = dataclasses.replace(out, prompt=None, prompt_token_ids=(), error=msg.portable(out.error))
            outputs.append(msg.Output(state.owner, out, timing))
        self.send(msg.Report(tuple(outputs), report.stats, msg.portable(report.fatal)))


def main(argv: list[str]) -> None:
    from runtime.executor.tp_rank import exit_with_parent, read_arguments

    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the process group: the front stops us)
    conn = Connection(int(argv[0]))
    args: msg.ReplicaArgs = read_arguments(sys.stdin.buffer)
    try:
        engine = build(args)
    except Exception as exc:
        conn.send(msg.Failed(msg.portable(exc)))
        from nanoinfer.errors import NanoInferError

        if isinstance(exc, NanoInferError):  # (a bad checkpoint or setting: the front raises it, once)
            sys.exit(1)
        raise  # (a bug: its traceback in the replica's output, exit code 1)
    Replica(engine, conn).run()
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
