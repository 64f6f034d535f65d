"""A launch over several machines without torchrun: `--nnodes`, `--node-rank`, `--master-addr`,
`--master-port` (SGLang's names) make `nanoinfer` start this node's ranks itself.

torchrun stays the reference (README, "Tensor parallelism"): each of its workers runs the same
command line with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, rank 0 becomes
the engine (and the server), every other rank follows its steps (runtime/executor/tensor_parallel.py).
This module sets the same variables, so that everything after it is the torchrun path: the
node's first rank is this process, the node's other ranks are children running the same command
line. A child dies with this process (PR_SET_PDEATHSIG), and this process stops its children
when it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from nanoinfer.errors import RequestError
from nanoinfer.settings import check_settings, setting


@dataclass(frozen=True)
class LaunchConfig:
    """Where this machine's ranks sit among all the machines' (each flag declared once)."""

    nnodes: int = setting(1, "machines the model's ranks span (tensor x pipeline-parallel size / nnodes ranks on "
                             "each); over 1, this command starts this machine's ranks itself, as torchrun would",
                          minimum=1)
    node_rank: int = setting(0, "this machine's index among --nnodes (0: the one that runs the engine and serves)",
                             minimum=0)
    master_addr: str = setting("127.0.0.1", "node 0's address, where the ranks meet")
    master_port: int = setting(29500, "the port on node 0 where the ranks meet", minimum=1, maximum=65535)

    def __post_init__(self):
        check_settings(self)
        if self.node_rank >= self.nnodes:
            raise RequestError(f"node_rank={self.node_rank} with nnodes={self.nnodes}: expected a node rank "
                               f"from 0 to {self.nnodes - 1}", param="node_rank")


class LocalRanks:
    """This node's ranks of a launch: the environment of this process (its first) and the other
    local ranks, started as children running `argv`."""

    def __init__(self, launch: LaunchConfig, world_size: int, argv: list[str]):
        if world_size % launch.nnodes:
            raise RequestError(f"{world_size} ranks over nnodes={launch.nnodes}: every node runs the same number "
                               f"of ranks, so tensor_parallel_size x pipeline_parallel_size must be a multiple of "
                               f"{launch.nnodes}", param="nnodes")
        per_node = world_size // launch.nnodes
        first = launch.node_rank * per_node

        def env(local: int) -> dict[str, str]:
            return {"RANK": str(first + local), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": launch.master_addr,
                    "MASTER_PORT": str(launch.master_port)}

        # (preexec_fn is safe here: the launch comes before the engine starts any thread)
        self.children = [subprocess.Popen([sys.executable, "-m", "runtime.cli", *argv], env={**os.environ, **env(i)},
                                          preexec_fn=_die_with_parent)  # noqa: PLW1509
                         for i in range(1, per_node)]
        os.environ.update(env(0))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the children (they have normally left with rank 0's stop already)."""
        for child in self.children:
            try:
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _die_with_parent() -> None:
    """In the child, before it runs: the kernel kills it when the launching process dies, however
    that ends (the rank would otherwise wait for rank 0 until its collectives time out)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # (not Linux: the child ends at its next collective instead)
        pass


def is_launched() -> bool:
    """True where torchrun (or LocalRanks) started this process as one rank of several."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ
