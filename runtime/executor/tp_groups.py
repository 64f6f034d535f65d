"""The tensor-parallel ranks' process groups and channel: timeouts, the rendezvous, joining and leaving the
groups, aborting NCCL's collectives when a rank dies, the control channel's ring (rank 0's side and the ranks').
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import _abort_process_group

from runtime.executor.control_channel import ChannelReader, ChannelWriter, channel_bytes
from runtime.executor.tp_grid import Grid
from runtime.executor.tp_processes import RankLost

log = logging.getLogger("nanoinfer.tensor_parallel")

# Long enough for the slowest step (a long CPU prefill); a rank that died ends the others sooner.
TIMEOUT = datetime.timedelta(minutes=10)
# Rank 0's rendezvous once every rank it started has checked in: moments, unless one died.
RENDEZVOUS = datetime.timedelta(seconds=6)
# A rank waits this long for rank 0's next order: an engine may idle for days (rank 0's end
# ends the wait sooner: its sockets close, and the ranks watch their parent).
IDLE = datetime.timedelta(days=365)
LEAVE_WAIT = 3.0  # seconds rank 0 gives leaving the process groups at close
# Rank 0's wait for the ranks in the peer sums' rendezvous (a wait on the store, which no watcher
# can cut short): the ranks connect as soon as the setup reaches them, so only a dead one is late.
CONNECT = datetime.timedelta(seconds=10)
# The control channel's ring (control_channel.py): a step's order (its header and Cut) fits a
# slot up to a few hundred sequences; a longer order takes several slots.
SLOTS, SLOT_SIZE = 32, 4096
# Seconds a rank polls for rank 0's next order before it sleeps between polls: on a GPU rank the
# whole wait of a step (its host core is idle meanwhile, and a sleep's wake-up would add up to a
# millisecond to every step); on CPU ranks a moment, since they share the cores with the model.
SPIN = {"cuda": 0.05, "cpu": 100e-6}


@contextlib.contextmanager
def store_timeout(timeout: datetime.timedelta):
    """Waits on the default group's store (and on every prefix of it: they wait with their
    TCPStore's timeout) give up after `timeout` inside; TIMEOUT again after (the store's, as
    the groups were made with it)."""
    store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    store.set_timeout(timeout)
    try:
        yield
    finally:
        store.set_timeout(TIMEOUT)


def backend_of(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the GPUs after rank 0's (`device`: cuda:k gives ranks cuda:k..k+size-1)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


class Rendezvous(NamedTuple):
    """Where the ranks meet: rank 0's TCPStore at host:port (the ranks it started itself), or
    torchrun's (env://: `host` None)."""

    host: str | None = None
    port: int | None = None


def maybe_a_peer(exc: BaseException) -> bool:
    """Whether `exc` may come of a lost rank (a collective's or the rendezvous's error), rather
    than being an error of rank 0's own (out of memory, a bad request)."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, (RankLost, torch.OutOfMemoryError))) or \
        isinstance(exc, (TimeoutError, OSError))


def report_lost(lost) -> None:
    """From the watch's thread: a rank died, maybe while the engine idles; its next step fails."""
    log.error("tensor-parallel rank %d exited (code %s): the engine's next step fails", lost.rank, lost.exit_code())


def abort_collectives(groups: list, lost) -> None:
    """From the watch's thread: a rank died, so NCCL's collectives with it would never end; the
    communicators aborted (the default group's and `groups`), they fail, and rank 0 reports the
    rank at its next step."""
    log.error("tensor-parallel rank %d exited (code %s): aborting the collectives", lost.rank, lost.exit_code())
    for group in [dist.group.WORLD, *groups]:
        try:
            group.abort()
        except Exception:
            log.warning("could not abort the NCCL communicator", exc_info=True)


def all_groups(stage_groups) -> list:
    """A pipeline's process groups besides the default one (which an abort of it does not reach)."""
    return [] if stage_groups is None else [g for g in stage_groups if g is not None]


def make_stage_groups(grid: Grid, rank: int, timeout: datetime.timedelta):
    """Pipeline parallelism's process groups (None with one stage), made by every rank alike."""
    if grid.pp == 1:
        return None
    from runtime.executor.pp_stages import stage_groups

    return stage_groups(grid.tp, grid.pp, rank, timeout)


def leave_groups(backend: str, together: bool = False) -> None:
    """Leave the process groups: gloo's destroyed; NCCL's destroyed where every rank does so at the
    same time (`together`: after a stop every rank took), else aborted (destroying them waits on
    peers that may be gone)."""
    if not dist.is_initialized():
        # A rendezvous that failed has counted its group all the same: the next engine's groups
        # would be named (their store keys prefixed) otherwise than its ranks'.
        distributed_c10d._world.group_count = 0
        return
    if backend == "nccl" and not together:
        _abort_process_group()
    else:
        dist.destroy_process_group()


def bounded(fn, seconds: float) -> None:
    """`fn()` in a thread, waited for at most `seconds` (a teardown that hangs leaves its thread behind)."""
    def run():
        try:
            fn()
        except Exception:
            log.warning("leaving the tensor-parallel process groups failed", exc_info=True)

    thread = threading.Thread(target=run, daemon=True, name="nanoinfer-tp-leave")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        log.warning("leaving the tensor-parallel process groups took over %.0f s: left behind", seconds)


def named_channel(control, rank: int, size: int, spin: float = 0.0) -> ChannelWriter | ChannelReader | None:
    """torchrun's side of the control channel (every rank calls it, at the same point): where every
    rank is on this host (LOCAL_WORLD_SIZE is WORLD_SIZE), rank 0 makes the ring as a file in
    /dev/shm, names it to the others over the control group, and removes the name once they have
    all mapped it (from then on nothing can be left behind, however the processes end); else
    None, and the orders go over the control group."""
    nbytes = channel_bytes(SLOTS, SLOT_SIZE, max(1, size - 1))
    if rank != 0:
        named = [None]
        dist.broadcast_object_list(named, src=0, group=control)
        if named[0] is None:
            return None
        fd = os.open(named[0], os.O_RDWR)
        try:
            channel = ChannelReader(mmap.mmap(fd, nbytes), rank - 1, spin=spin)
        finally:
            os.close(fd)
        dist.barrier(group=control)
        return channel
    if size == 1 or os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE") \
            or not os.path.isdir("/dev/shm"):
        dist.broadcast_object_list([None], src=0, group=control)
        return None
    path = f"/dev/shm/nanoinfer-control-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        channel = ChannelWriter(mmap.mmap(fd, nbytes), SLOTS, SLOT_SIZE, size - 1, timeout=TIMEOUT.total_seconds(),
                                names=lambda i: f"tensor-parallel rank {i + 1}")  # (the layout the readers check)
        dist.broadcast_object_list([path], src=0, group=control)
        dist.barrier(group=control)  # (every rank has mapped it)
    finally:
        os.close(fd)
        os.unlink(path)
    return channel
