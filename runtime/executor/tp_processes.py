"""The tensor-parallel ranks that the engine starts on its host: processes of our own module, watched until they stop.

Each rank other than 0 is `python -m runtime.executor.tp_rank RANK SIZE HOST:PORT`, whatever
the user's program is (a notebook, `python -`, a script without a main guard: nothing of it
runs again). Rank 0 hands each rank its arguments, the weights among them, on the rank's
stdin, pickled as torch.multiprocessing pickles them: CPU tensors travel as shared memory
(file descriptors the rank fetches from this process's resource sharer, which authenticates
it by this process's authkey, sent first), CUDA tensors as CUDA IPC handles — what a spawned
process's arguments were before. Nothing is copied but the pickle's few bytes a tensor.

A rank's stdout and stderr come back through one pipe: its lines go on to this process's
stderr, and the last of them are kept, so that a rank that dies is reported with the tail of
its traceback (RankLost: its rank, its exit code, its last lines).
"""

from __future__ import annotations

import collections
import io
import logging
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch.multiprocessing  # noqa: F401 - (importing it registers torch's reductions with ForkingPickler)

from nanoinfer.errors import DeviceLost

log = logging.getLogger("nanoinfer.tensor_parallel")

TAIL_LINES = 20  # of a lost rank's output, in its error: a Python traceback's end fits
TAIL_CHARS = 3000
STOP_WAIT = 4.0  # seconds the ranks have to leave after `stop` before they are killed
POLL = 0.05


class RankLost(DeviceLost):
    """A tensor-parallel rank's process is gone: the model is incomplete, nothing can run."""


class RankProcess:
    """One rank's process, its output's last lines, and why it ended. (A data-parallel replica's process too:
    `label` prefixes its lines, `pass_fds` are inherited, see runtime/engine_process/client.py.)"""

    label = "tp rank"

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()):
        self.rank = rank
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, pass_fds=pass_fds)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.ready_line: str | None = None  # a line (part) that, once the process prints it, sets `ready`
        self.ready = threading.Event()
        self.killed = False  # by us, at close: not a death to report
        self.reported = False  # its RankLost was raised already
        self._reader = threading.Thread(target=self._read_output, daemon=True,
                                        name=f"nanoinfer-{self.label.replace(' ', '-')}{rank}-output")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, data: bytes) -> None:
        """The rank's arguments, then end of input (a rank that died first is reported by the watch)."""
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:  # (BrokenPipeError: it is gone)
            pass

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def lost(self, when: str = "") -> RankLost:
        """The error that reports this (exited) rank: its exit code and its output's last lines."""
        how, last = self.exit_and_tail()
        return RankLost(f"tensor-parallel rank {self.rank} exited{when} ({how}): the engine cannot run the model "
                        f"without it; {last}")

    def exit_and_tail(self) -> tuple[str, str]:
        """How the (exited) process ended ("code -9, SIGKILL"), and its output's last lines (as a clause)."""
        self.reported = True
        self._reader.join(timeout=1)  # (the pipe's end follows the exit; a straggling grandchild may hold it)
        code = self.proc.returncode
        how = f"code {code}"
        if code is not None and code < 0:
            try:
                how += f", {signal.Signals(-code).name}"
            except ValueError:
                pass
        tail = "".join(self.tail)[-TAIL_CHARS:].rstrip()
        return how, f"its last output:\n{tail}" if tail else "it wrote nothing"

    def _read_output(self) -> None:
        """Until the pipe's end: each line on to our stderr, prefixed with the rank, and kept in the tail."""
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            self.tail.append(line)
            if self.ready_line is not None and self.ready_line in line:
                self.ready.set()
            try:
                sys.stderr.write(f"[{self.label} {self.rank}] {line}")
            except (OSError, ValueError):  # (a closed or redirected stderr loses the echo, never the tail)
                pass
        self.proc.stdout.close()


class RankProcesses:
    """Ranks 1..size-1 of this host's engine: started, handed their arguments, watched, stopped."""

    def __init__(self, size: int, address: tuple[str, int], payload: Callable[[int], object],
                 module: str = "runtime.executor.tp_rank"):
        """Start the ranks (`module`, run with `-m`), and send each `payload(rank)` (its arguments) on its stdin."""
        host, port = address
        authkey = bytes(multiprocessing.current_process().authkey)
        self.ranks: list[RankProcess] = []
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        try:
            for rank in range(1, size):
                self.ranks.append(RankProcess(rank, [*_python(), "-m", module, str(rank), str(size), f"{host}:{port}"],
                                              _environment()))
            for r in self.ranks:  # (one pickle a rank: each shared tensor's descriptor is fetched once)
                buf = io.BytesIO()
                ForkingPickler(buf).dump(payload(r.rank))
                data = struct.pack("<I", len(authkey)) + authkey + buf.getvalue()
                # (from a thread: a pickle over the pipe's buffer waits for the rank to read it)
                threading.Thread(target=r.send, args=(data,), daemon=True,
                                 name=f"nanoinfer-tp-rank{r.rank}-send").start()
        except BaseException:
            self.stop(wait=0)
            raise

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [r.proc for r in self.ranks]

    def first_lost(self) -> RankProcess | None:
        """A rank whose process has exited, if any."""
        return next((r for r in self.ranks if r.exit_code() is not None), None)

    def check(self, when: str = "") -> None:
        """RankLost for a rank that has exited."""
        lost = self.first_lost()
        if lost is not None:
            raise lost.lost(when)

    def wait_lost(self, seconds: float) -> RankProcess | None:
        """A rank that has exited or exits within `seconds` (after a collective failed: the peer's
        end of a socket closes as its process exits, which we see a moment later)."""
        deadline = time.monotonic() + seconds
        while (lost := self.first_lost()) is None and time.monotonic() < deadline:
            time.sleep(POLL)
        return lost

    def wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        """Until `ready()` (the ranks have checked in at the rendezvous), polling for a rank that died."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.check(" while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tensor-parallel ranks did not start in {timeout:.0f} s")
            time.sleep(POLL)

    def watch(self, on_lost: Callable[[RankProcess], None], every: float = 0.5) -> None:
        """Call `on_lost` (from a thread) once when a rank exits before `stop` (NCCL's collectives
        would wait for it forever: `on_lost` aborts them)."""
        def run():
            while not self._stopping.wait(every):
                lost = self.first_lost()
                if lost is not None:
                    on_lost(lost)
                    return

        self._watch = threading.Thread(target=run, daemon=True, name="nanoinfer-tp-watch")
        self._watch.start()

    def unwatch(self) -> None:
        self._stopping.set()

    def stop(self, wait: float = STOP_WAIT) -> list[RankLost]:
        """Wait up to `wait` seconds for the ranks to exit (they were told to), kill the rest; the
        ranks that ended badly on their own (an exit code other than 0), as errors."""
        self.unwatch()
        wait_or_kill(self.ranks, wait)
        return [r.lost(" before the engine closed") for r in self.ranks
                if r.proc.returncode != 0 and not (r.killed or r.reported)]


def wait_or_kill(processes: Sequence[RankProcess], wait: float) -> None:
    """Up to `wait` seconds for `processes` (told to stop) to exit; those still running are killed (`killed`: by
    us, no death to report), and every one waited for."""
    deadline = time.monotonic() + wait
    for process in processes:
        try:
            process.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.killed = True
            process.proc.kill()
    for process in processes:
        process.proc.wait()


def _python() -> list[str]:
    """This interpreter; where it can (3.11+), not putting the working directory first on the
    path, where a module of the user's could stand in for one of ours."""
    return [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]


def _environment() -> dict[str, str]:
    """Ours, with the directory our packages were imported from first on the path: a rank runs
    the engine's code, whatever the working directory and the installed copy are."""
    import runtime

    root = str(Path(runtime.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env
