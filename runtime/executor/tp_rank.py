"""A tensor-parallel rank that the engine started on its host: `python -m runtime.executor.tp_rank RANK SIZE HOST:PORT`.

HOST:PORT is rank 0's rendezvous (its TCPStore). The rest of the rank's arguments come on
stdin (runtime/executor/tp_processes.py): rank 0's authkey, which its resource sharer asks of
whoever fetches the shared weights, then (config, weights, device) pickled as
torch.multiprocessing pickles them, the ranks' grid (tensor- by pipeline-parallel) and the
control channel's memory (a shared tensor, as the weights: control_channel.py). Then
the rank follows rank 0's orders until `stop` (runtime/executor/tp_follower.py: `rank_main`).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import struct
import sys
import threading
import time
from typing import BinaryIO


def exit_with_parent(parent: int) -> None:
    """A rank whose engine process died (SIGKILL, SIGTERM without cleanup) exits too. Inside a
    collective gloo notices the closed peer by itself; this covers the rest (the rendezvous
    of a start that the engine did not live through would wait for its timeout)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def read_arguments(stream: BinaryIO):
    """Rank 0's authkey (ours from now on, for its resource sharer), then the pickled arguments."""
    import torch.multiprocessing  # noqa: F401 - (the rebuild functions of shared tensors)

    (n,) = struct.unpack("<I", stream.read(4))
    multiprocessing.current_process().authkey = stream.read(n)
    return pickle.load(stream)


def main(argv: list[str]) -> None:
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    # Ctrl-C in a terminal reaches the whole process group: the engine decides, and stops its ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, size, address = int(argv[0]), int(argv[1]), argv[2]
    host, port = address.rsplit(":", 1)
    cfg, params, device, grid, ring = read_arguments(sys.stdin.buffer)

    from runtime.executor.tp_follower import rank_main
    from runtime.executor.tp_groups import Rendezvous

    rank_main(rank, size, Rendezvous(host, int(port)), cfg, params, device, grid, ring)


if __name__ == "__main__":
    main(sys.argv[1:])
