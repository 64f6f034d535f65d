"""The entry of each more API server (`python -m runtime.serve.api_servers_main FD...`, started by the first's
ApiServers: runtime/serve/api_servers.py): its DataParallelEngine over the engine processes' sockets it was handed,
serving the shared port until the first stops it or its engines are gone."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from runtime.serve.api_servers import ApiServerArgs, listening_socket


def main(argv: list[str]) -> None:
    from runtime.engine_process.data_parallel import DataParallelEngine
    from runtime.engine_process.client import EngineElsewhere, ReplicaClient
    from runtime.executor.tp_rank import exit_with_parent, read_arguments
    from runtime.serve.serving import serve

    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    conns = [Connection(int(fd)) for fd in argv]
    args: ApiServerArgs = read_arguments(sys.stdin.buffer)
    replicas: list[ReplicaClient] = []
    for index, conn in enumerate(conns):
        replicas.append(ReplicaClient(index, EngineElsewhere(index), conn, group=replicas, alone=len(conns) == 1,
                                      step_timeout=args.engine.step_timeout))
    for replica in replicas:
        replica.wait_ready()  # (each engine process says Ready to every front)
    engine = DataParallelEngine(replicas, args.engine)
    threading.Thread(target=_stop_without_engines, args=(replicas,), daemon=True, name="engine-watch").start()
    serve(engine, args.server, sockets=[listening_socket(args.server.host, args.port)], index=args.index)


def _stop_without_engines(replicas) -> None:
    """An API server whose engine processes are all gone (or which one dropped as hung) stops (SIGTERM: it
    drains, answering what it holds with errors): a front left on the shared port could only refuse its share
    of the connections, which the others take once it is gone."""
    while not all(replica.link.gone is not None for replica in replicas):
        time.sleep(0.5)
    if any(replica.link.stopping for replica in replicas):
        return  # (this server's own shutdown stopped them)
    print(f"nanoinfer: API server stopping: {replicas[0].link.gone}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main(sys.argv[1:])
