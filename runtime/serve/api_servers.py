"""More HTTP fronts: `serve --api-server-count N` — N-1 processes more serving the same port over the same engine.

One front process writes every stream's chunks in one interpreter; past a few hundred streams that is a core's work
(bench/RESULTS.md, issue 60), and the streams' latency follows it. With --api-server-count N (vLLM's name) the
first process — the one `nanoinfer serve` runs — starts the engine processes with a socket for each front
(runtime/engine_process/client.py's `spawn`), then N-1 processes `python -m runtime.serve.api_servers_main FD...`
(api_servers_main.py), each handed its end of every engine process's socket and the port. Each binds the port as
the first does (SO_REUSEPORT: the kernel spreads new connections over them), makes its own DataParallelEngine over
the same engine processes (they are not its children: EngineElsewhere, the first watches and stops them) and serves
as the first does; a request stays with its connection's front. On SIGTERM the first tells the others, and all
drain together; the others end with the first however it ends. Each front's /metrics counts its own requests; the
engine's counts are the engine's, the same in every front.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import NamedTuple

from runtime.engine_config import EngineConfig
from runtime.serve.server_config import ServerConfig

# seconds past the shutdown timeout for the other API servers to exit (then they are killed): their streams' error
# events, then uvicorn's own graceful stop (10 s)
STOP_GRACE = 20.0
STARTUP_TIMEOUT = 120.0  # seconds for each to start serving (an interpreter, torch, the tokenizer)


class ApiServerArgs(NamedTuple):
    index: int  # 1..N-1 (the first is 0)
    server: ServerConfig
    engine: EngineConfig
    port: int  # the port the first bound (a chosen one where --port was 0)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port) that the other API servers' sockets share (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class ApiServers:
    """The other API server processes of a server, started by its first over `engine` (a DataParallelEngine whose
    replicas were started with a socket for each: `fronts=N`)."""

    def __init__(self, engine, config: ServerConfig, port: int):
        from runtime.executor.tp_processes import RankProcess, _environment, _python

        class ApiServerProcess(RankProcess):
            label = "api server"

        self.processes: list[RankProcess] = []
        engine_config = engine.config
        try:
            for index in range(1, config.api_server_count):
                conns: list[Connection] = [replica.front_conns[index - 1] for replica in engine.replicas]
                fds = tuple(conn.fileno() for conn in conns)
                process = ApiServerProcess(index, [*_python(), "-m", "runtime.serve.api_servers_main", *map(str, fds)],
                                           _environment(), pass_fds=fds)
                process.ready_line = f"API server {index} serving at"  # (serving.py's line: it takes connections)
                self.processes.append(process)
                authkey = bytes(multiprocessing.current_process().authkey)
                data = pickle.dumps(ApiServerArgs(index, config, engine_config, port))
                threading.Thread(target=process.send, args=(struct.pack("<I", len(authkey)) + authkey + data,),
                                 daemon=True, name=f"nanoinfer-api-server{index}-send").start()
        except BaseException:
            self.stop(0.0)
            raise
        finally:
            for replica in engine.replicas:  # (theirs now: a copy kept here would hold a closed front's socket open)
                for conn in replica.front_conns:
                    conn.close()
                replica.front_conns = []

    def wait_serving(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until each says it serves (its "serving at" line), so that the first's own line means every front
        takes connections; the error naming one that exited first, or took longer than `timeout` seconds."""
        from nanoinfer.errors import NanoInferError

        deadline = time.monotonic() + timeout
        for process in self.processes:
            while not process.ready.wait(0.05):
                if process.exit_code() is not None:
                    how, last = process.exit_and_tail()
                    raise NanoInferError(f"API server {process.rank} exited while starting ({how}); {last}")
                if time.monotonic() > deadline:
                    raise NanoInferError(f"API server {process.rank} did not start serving in {timeout:g} s")
                time.sleep(0.05)

    def terminate(self) -> None:
        """Tell each to drain and stop (SIGTERM: as `serve` itself is told)."""
        for process in self.processes:
            if process.exit_code() is None:
                process.proc.send_signal(signal.SIGTERM)

    def stop(self, wait: float) -> None:
        """SIGTERM to each, then up to `wait` seconds for all to exit; the rest are killed."""
        from runtime.executor.tp_processes import wait_or_kill

        self.terminate()
        wait_or_kill(self.processes, wait)
