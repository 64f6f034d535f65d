"""Tensor-parallel ranks for the engine: worker processes that run each forward beside rank 0.

The engine stays one process (rank 0: scheduler, sampler, its own shard of the model). For
`tensor_parallel_size` N it starts ranks 1..N-1, one process each, running our own module
(tp_rank.py, started and watched by tp_processes.py: never the user's program, so a notebook,
`python -` and a script without a main guard work); every rank holds its shard of the weights
(nanoinfer/parallel/shards.py) and a KV pool of its own heads, indexed by rank 0's block
tables. Rank 0 tells the others what to do, in the order it does it:

- `forward`: before each of its forwards, the step's Batch (a header with the shapes, then
  the tensors in one broadcast). Every rank runs the same forward, so
  their collectives (an all-reduce after each row-parallel projection, the vocab-parallel
  embedding, the gathered logits) meet; only rank 0 samples.
- `copy`, `swap_out`, `swap_in`: the block copies of copy-on-write and preemption.
- `ready`: once rank 0 is set up, a barrier: a rank that failed its setup fails the start.
- `stop`: at close; the ranks leave their loop and exit. Each watches its parent besides:
  none outlives the engine's process, however it ends.

A rank that dies, at any moment, fails the engine within seconds (RankLost, fatal: its rank,
exit code and last lines of output): rank 0 polls the ranks while they start, meets them at
the rendezvous only once all have checked in (with a short timeout there), turns a
collective's failure into the loss of the rank that died, and (NCCL, whose collectives would
wait forever) aborts the communicator from a watching thread. `close()` returns within
seconds: the ranks are told to stop, stragglers killed, then the groups are left (NCCL's
aborted, since destroying them waits on peers).

Ranks take the weights from rank 0 (shared memory on the CPU, CUDA IPC on GPUs) and shard them themselves.
Across hosts, torchrun starts every rank instead (each loads the model itself: `serve_rank`),
and they meet at its rendezvous (env://).
The collectives are torch.distributed's: gloo on the CPU, NCCL on CUDA. The orders (all but
the batch's tensors) go over a ring in shared memory (control_channel.py: a few microseconds an
order, where a gloo broadcast took a quarter of a millisecond of rank 0's step) to the ranks
this engine started, and to torchrun's where all are on this host (LOCAL_WORLD_SIZE is
WORLD_SIZE: `_named_channel`); across hosts over a gloo group (the control group, which every
rank keeps for the `ready` barrier). A rank waits for orders without a timeout: an engine may idle.
The default process group is the process's: one tensor-parallel engine per process at a time.
With pipeline parallelism the ranks form a grid (`Grid`: stages of tensor-parallel ranks;
runtime/executor/pipeline_parallel.py runs the stages): the same processes, orders and faults.
On CUDA every rank captures the same graphs as rank 0, its collectives inside (NCCL's kernels
capture like any other), and replays the one rank 0 replays: the decision follows from the
batch, which every rank has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import logging
import mmap
import os
import pickle
import threading
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import _abort_process_group, _set_pg_timeout

from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.errors import DeviceLost, RequestError
from nanoinfer.backends.cuda.graphs import GraphSizes, StepGraphs
from nanoinfer.backends.choose import kernels_for
from nanoinfer.model.kv_cache import kv_bytes_per_block
from nanoinfer.loaders import LoadedModel
from nanoinfer.model.decoder import Params, forward, map_params
from nanoinfer.parallel.shards import (
    Shard,
    check_shardable,
    layer_functions,
    shard_config,
    shard_params,
)
from runtime.executor.control_channel import ChannelReader, ChannelWriter, channel_bytes
from runtime.executor.kv_pools import KVPools
from runtime.executor.model_runner import ModelRunner
from runtime.executor.tp_processes import RankLost, RankProcesses

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
RANK_MODULE = "runtime.executor.tp_rank"  # what a rank this engine starts runs (`python -m`)


class RankSetup(NamedTuple):
    """What a rank needs besides the weights, sent once rank 0 has sized its KV pool."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    eager: bool  # kernels_for's (enforce_eager): no fused layers, no graphs
    graphs: GraphSizes | None  # the CUDA graphs rank 0 captures, which every rank captures alike
    micro_batches: int = 1  # pipeline parallelism: the most micro-batches a step is cut into
    peer_sums: bool = False  # one-token sums over NVLink peer memory (nanoinfer.backends.cuda.peer_sum), connected now


class Grid(NamedTuple):
    """How the ranks lay out: `pp` pipeline stages of `tp` tensor-parallel ranks each, rank =
    stage * tp + its shard (rank 0, the engine: the first stage's first shard)."""

    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.pp

    def place(self, rank: int) -> tuple[int, int]:
        """(stage, shard) of `rank`."""
        return divmod(rank, self.tp)


def rank_config(cfg: ModelConfig, grid: Grid, rank: int) -> ModelConfig:
    """Rank `rank`'s view of the model (rank_part's config, without the weights)."""
    stage, shard = grid.place(rank)
    if grid.pp > 1:
        from nanoinfer.parallel.pipeline import Stage, stage_config

        cfg = stage_config(cfg, Stage(stage, grid.pp))
        if grid.tp == 1:
            return cfg
    return shard_config(cfg, shard, grid.tp)


def rank_part(cfg: ModelConfig, params: Params, grid: Grid, rank: int) -> tuple[ModelConfig, Params]:
    """Rank `rank`'s view of the model and its weights: its stage's layers, of those its shard."""
    stage, shard = grid.place(rank)
    if grid.pp > 1:
        from nanoinfer.parallel.pipeline import Stage, stage_config, stage_params

        params, cfg = stage_params(params, cfg, Stage(stage, grid.pp)), stage_config(cfg, Stage(stage, grid.pp))
        if grid.tp == 1:  # (one shard: the stage's weights as they are)
            return cfg, params
    return shard_config(cfg, shard, grid.tp), shard_params(params, cfg, shard, grid.tp)


def rank_layer_functions(base, grid: Grid, rank: int, vocab_size: int, tp_group, links=None):
    """Rank `rank`'s layers with the collectives of its stage's shards (`tp_group`: theirs, None
    for the default group when there is one stage; `links`: nanoinfer.backends.cuda.peer_sum's, or None)."""
    if grid.pp > 1 and grid.tp == 1:
        return base
    return layer_functions(base, Shard(grid.place(rank)[1], grid.tp), vocab_size, tp_group, links)


def peer_links(cfg: ModelConfig, grid: Grid, rank: int, dtype: torch.dtype, device: torch.device):
    """Rank `rank`'s nanoinfer.backends.cuda.peer_sum links where its one-token sums can take them (tensor
    parallelism alone, on CUDA, in a 16-bit model), else None. Not yet connected. Whether this
    engine uses them is rank 0's choice (`lead_peer_links`), which the ranks follow."""
    if device.type != "cuda" or grid.pp > 1 or grid.tp == 1 or dtype not in (torch.bfloat16, torch.float16):
        return None
    from nanoinfer.backends.cuda.peer_sum import PeerLinks

    return PeerLinks(rank, grid.tp, cfg.hidden_size, dtype, device)


def lead_peer_links(cfg: ModelConfig, grid: Grid, dtype: torch.dtype, device: torch.device):
    """Rank 0's peer links (`peer_links`) where this engine can use them: every rank on this
    host (torchrun's LOCAL_WORLD_SIZE, where torchrun started them), each rank's GPU able to
    reach every other's memory, and no rendezvous made in this process before (see
    nanoinfer.backends.cuda.peer_sum: a later engine's would wait for ever); else None, and a warning says
    why. The ranks follow this choice (RankSetup.peer_sums)."""
    links = peer_links(cfg, grid, 0, dtype, device)
    if links is None:
        return None
    why = None
    if launched_rank() is not None and int(os.environ.get("LOCAL_WORLD_SIZE", 0)) != grid.size:
        why = "the ranks are not all on this host (torchrun's LOCAL_WORLD_SIZE)"
    elif not _peers_reach(device, grid.size):
        why = "these GPUs cannot all reach each other's memory"
    elif not links.first_in_process():
        why = ("an engine of this process connected them before, and torch's symmetric memory meets new ranks "
               "once a process (nanoinfer.backends.cuda.peer_sum)")
    if why is None:
        return links
    log.warning("peer sums: %s; this engine sums with NCCL", why)
    return None


@contextlib.contextmanager
def _store_timeout(timeout: datetime.timedelta):
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


def _peers_reach(device: torch.device, size: int) -> bool:
    """Whether the GPUs of ranks 0..size-1 (from `device` on) can each access the others' memory."""
    first = device.index or 0
    gpus = range(first, first + size)
    return first + size <= torch.cuda.device_count() and all(
        torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the GPUs after rank 0's (`device`: cuda:k gives ranks cuda:k..k+size-1)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


class Rendezvous(NamedTuple):
    """Where the ranks meet: rank 0's TCPStore at host:port (the ranks it started itself), or
    torchrun's (env://: `host` None)."""

    host: str | None = None
    port: int | None = None


class TensorParallelRanks:
    """Rank 0's side: starts the other ranks, joins them in a process group, and sends them
    each step's work."""

    channel: ChannelWriter | None = None  # the orders' way to the ranks this engine started (None: the control group)

    def __init__(self, cfg: ModelConfig, params: Params, grid: Grid | int, peer_sums: bool = False):
        grid = grid if isinstance(grid, Grid) else Grid(grid)
        _check_grid(cfg, grid)
        self.cfg, self.grid, self.size = cfg, grid, grid.size
        size = grid.size
        device = params.device
        self.links = lead_peer_links(cfg, grid, params.dtype, device) if peer_sums else None
        self.backend = _backend(device)
        self.launch: RankProcesses | None = None
        self.stage_groups = None  # pipeline parallelism's (pipeline_parallel.StageGroups)
        launched = launched_rank()
        if launched is not None:  # torchrun started every rank: they meet at its rendezvous
            if launched != (0, size):
                raise RequestError(f"tensor_parallel_size={grid.tp} x pipeline_parallel_size={grid.pp}, but torchrun "
                                   f"started this process as rank {launched[0]} of {launched[1]} (RANK, WORLD_SIZE): "
                                   f"expected rank 0 of {size}", param="tensor_parallel_size")
            dist.init_process_group(self.backend, init_method="env://", rank=0, world_size=size, timeout=TIMEOUT)
            self.control = dist.new_group(backend="gloo", timeout=TIMEOUT)
            self.stage_groups = _stage_groups(grid, 0, TIMEOUT)
            self.channel = _named_channel(self.control, 0, size)
        else:
            self.control = self._start(cfg, params, size)
        self.closed = False

    def _start(self, cfg: ModelConfig, params: Params, size: int):
        """Ranks 1..size-1 as processes of our own module (tp_rank.py), each handed the weights,
        then the process group; the control group returned. A rank that dies meanwhile fails the
        start within moments (RankLost), not at the rendezvous's timeout."""
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        device = params.device
        # The orders' ring goes with the weights: a tensor in shared memory, which reaches each rank
        # as a file descriptor and has no name (none is left in /dev/shm, however the processes end).
        ring = None
        if size > 1:  # (a world of one, as a test's on one GPU, has nobody to order)
            ring = torch.zeros(channel_bytes(SLOTS, SLOT_SIZE, size - 1), dtype=torch.uint8).share_memory_()
            self.channel = ChannelWriter(ring.numpy(), SLOTS, SLOT_SIZE, size - 1, check=self.check_ranks,
                                         timeout=TIMEOUT.total_seconds(),
                                         names=lambda i: f"tensor-parallel rank {i + 1}")
        self.launch = RankProcesses(size, ("127.0.0.1", store.port),
                                    lambda rank: (cfg, params, _rank_device(device, rank), self.grid, ring),
                                    RANK_MODULE)
        try:
            # The ranks check in once their shard is ready, just before the rendezvous: waiting for
            # that, rank 0 sees a rank that dies; the rendezvous itself then takes a moment, and a
            # rank lost within it fails it at a short timeout.
            ready = [f"ready/{rank}" for rank in range(1, size)]
            self.launch.wait_ready(lambda: store.check(ready), TIMEOUT.total_seconds())
            gloo = self.backend == "gloo"  # (NCCL's group connects at its first collective: no wait here)
            dist.init_process_group(self.backend, store=store, rank=0, world_size=size,
                                    timeout=RENDEZVOUS if gloo else TIMEOUT)
            control = dist.new_group(backend="gloo", timeout=RENDEZVOUS)
            self.stage_groups = _stage_groups(self.grid, 0, RENDEZVOUS)
            if gloo:
                _set_pg_timeout(TIMEOUT)
            _set_pg_timeout(TIMEOUT, control)
            for group in _groups(self.stage_groups):
                _set_pg_timeout(TIMEOUT, group)
        except BaseException as exc:  # (no group to stop them through: the ranks just started go now)
            lost = self.launch.wait_lost(2.0) if _maybe_a_peer(exc) else None
            self.launch.stop(wait=0)
            _bounded(lambda: _leave_groups(self.backend), LEAVE_WAIT)
            if lost is not None:
                raise lost.lost(" while starting") from exc
            raise
        self.launch.watch(functools.partial(_abort_collectives, _groups(self.stage_groups)) if self.backend == "nccl"
                          else _report)
        return control

    @property
    def procs(self) -> list:
        """The processes of ranks 1..size-1 when this engine started them (subprocess.Popen)."""
        return self.launch.procs if self.launch is not None else []

    def local(self, params: Params) -> tuple[ModelConfig, Params]:
        """Rank 0's view of the model and its part of the weights."""
        return rank_part(self.cfg, params, self.grid, 0)

    def layer_functions(self, base):
        tp_group = None if self.stage_groups is None else self.stage_groups.tp
        return rank_layer_functions(base, self.grid, 0, self.cfg.vocab_size, tp_group, self.links)

    def setup(self, setup: RankSetup) -> None:
        """The ranks' setup; they connect the peer links on taking it, as rank 0 does here."""
        self._send(("setup", setup._replace(peer_sums=self.links is not None)))
        if self.links is not None:
            with self.watching(), _store_timeout(CONNECT):
                self.links.connect(dist.group.WORLD.group_name)

    def ready(self) -> None:
        """Once rank 0 is set up: wait for every rank to be (a rank that failed its setup fails
        the engine's start, rather than its first step)."""
        self._send(("ready", None))
        with self.watching():
            dist.barrier(group=self.control)

    def forward(self, batch: Batch, cut: Cut | None = None) -> tuple[torch.Tensor, object]:
        """Before rank 0's own forward over `batch`: the other ranks receive it and start theirs
        (a graph's replay where rank 0's graphs take it: theirs are the same). `cut`: the batch's
        layout on the host, for ranks that cut it into micro-batches (pipeline parallelism):
        then the batch's broadcast is returned unwaited, (its tensor, its work), for the caller
        to wait for where rank 0's own work does not depend on it (on NCCL the other ranks
        take it only once their GPU is done with the step before)."""
        self.check_ranks()
        with self.watching():
            header = _forward_header(batch, cut is not None)
            if self.channel is not None:  # (the header and the cut as one message)
                self.channel.write(np.array(header if cut is None else
                                            [*header, *cut.query_start_loc, *cut.logits_indices], np.int64))
            else:
                dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=self.control)
                if cut is not None:
                    dist.broadcast(torch.tensor([*cut.query_start_loc, *cut.logits_indices], dtype=torch.int64),
                                   src=0, group=self.control)
            flat = torch.cat([t.reshape(-1).to(torch.int64) for t in batch])
            return flat, dist.broadcast(flat, src=0, async_op=cut is not None)

    def copy_blocks(self, copies) -> None:
        self._send(("copy", copies))

    def swap_out(self, copies) -> None:
        self._send(("swap_out", copies))

    def swap_in(self, copies) -> None:
        self._send(("swap_in", copies))

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent), within seconds whatever
        state the ranks are in: those that do not leave when told are killed; one that ended
        badly on its own is logged as an error."""
        if self.closed:
            return
        self.closed = True
        if self.links is not None:  # (before the groups: its memory is mapped through them)
            self.links.close()
        if self.launch is None:  # (torchrun's ranks, or a world of one: nobody to wait for but the order's peers)
            try:
                self._send(("stop", None))
            finally:
                _leave_groups(self.backend)
            return
        self.launch.unwatch()  # (what fails from now on is reported below)
        # The order goes from a thread: a rank that does not take it (hung, stopped) would hold
        # gloo's send until the collective timeout; the rank is killed below, which ends the send.
        delivered = threading.Event()

        def send_stop():
            try:
                if self.launch.first_lost() is None:
                    self._send(("stop", None))
                    if self.channel is None or self.channel.drained(LEAVE_WAIT):  # (written is not yet taken)
                        delivered.set()
            except Exception:  # noqa: BLE001 - a rank gone: the others are stopped all the same (killed if need be)
                log.warning("stopping the tensor-parallel ranks: a rank was gone")

        sending = threading.Thread(target=send_stop, daemon=True, name="nanoinfer-tp-stop")
        sending.start()
        if self.backend == "nccl" and delivered.wait(LEAVE_WAIT):
            # Every rank took the stop and destroys its communicators now: NCCL's destroy returns
            # once all ranks call it, so rank 0 calls it at the same time, before waiting for their
            # exit (waiting first was the hang of issue 33: each side waited for the other).
            _bounded(lambda: _leave_groups(self.backend, together=True), LEAVE_WAIT)
            lost = self.launch.stop()
        else:
            lost = self.launch.stop()
            sending.join(LEAVE_WAIT)
            # Last, with no peer left to wait for (NCCL's communicators are aborted, not destroyed).
            _bounded(lambda: _leave_groups(self.backend), LEAVE_WAIT)
        self.channel = None  # (its memory goes with the last process that maps it)
        for error in lost:
            log.error("%s", error)

    def check_ranks(self) -> None:
        """RankLost for a rank whose process has exited (a collective with it would fail or wait)."""
        if self.launch is not None:
            self.launch.check()

    @contextlib.contextmanager
    def watching(self, step: bool = False):
        """Collectives inside: their failure because a rank died is reported as that rank's loss.
        `step`: rank 0's part of a step that the other ranks run with it, where any failure (out
        of memory mid-forward) leaves them waiting in collectives that rank 0 will not make, and
        every later one out of step: it ends the engine (DeviceLost) rather than one step."""
        try:
            yield
        except DeviceLost:
            raise
        except Exception as exc:
            if self.launch is not None and _maybe_a_peer(exc):
                lost = self.launch.wait_lost(2.0)  # (its socket closes a moment before its exit is seen)
                if lost is not None:
                    raise lost.lost() from exc
            if not step or self.size == 1:  # (no peer: the step is contained as on one GPU)
                raise
            raise DeviceLost(f"rank 0 failed in the middle of a step that the other {self.size - 1} tensor- or "
                             f"pipeline-parallel ranks run with it ({exc!r}): their collectives are out of step "
                             f"with its, so nothing can run on them again") from exc

    def _send(self, message) -> None:
        """An order other than a forward: (kind, body), pickled."""
        self.check_ranks()
        with self.watching():
            if self.channel is not None:
                self.channel.write(_OBJECT + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
                return
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[0] = OBJECT
            dist.broadcast(header, src=0, group=self.control)
            dist.broadcast_object_list([message], src=0, group=self.control)


def _maybe_a_peer(exc: BaseException) -> bool:
    """Whether `exc` may come of a lost rank (a collective's or the rendezvous's error), rather
    than being an error of rank 0's own (out of memory, a bad request)."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, (RankLost, torch.OutOfMemoryError))) or \
        isinstance(exc, (TimeoutError, OSError))


def _report(lost) -> None:
    """From the watch's thread: a rank died, maybe while the engine idles; its next step fails."""
    log.error("tensor-parallel rank %d exited (code %s): the engine's next step fails", lost.rank, lost.exit_code())


def _abort_collectives(groups: list, lost) -> None:
    """From the watch's thread: a rank died, so NCCL's collectives with it would never end; the
    communicators aborted (the default group's and `groups`), they fail, and rank 0 reports the
    rank at its next step."""
    log.error("tensor-parallel rank %d exited (code %s): aborting the collectives", lost.rank, lost.exit_code())
    for group in [dist.group.WORLD, *groups]:
        try:
            group.abort()
        except Exception:
            log.warning("could not abort the NCCL communicator", exc_info=True)


def _groups(stage_groups) -> list:
    """A pipeline's process groups besides the default one (which an abort of it does not reach)."""
    return [] if stage_groups is None else [g for g in stage_groups if g is not None]


def _check_grid(cfg: ModelConfig, grid: Grid) -> None:
    """RequestError naming what keeps `cfg` from running over `grid`, before any rank starts."""
    if grid.tp > 1 or grid.pp == 1:
        check_shardable(cfg, grid.tp)
    if grid.pp > 1:
        from nanoinfer.parallel.pipeline import Stage, stage_config

        stage_config(cfg, Stage(0, grid.pp))


def _stage_groups(grid: Grid, rank: int, timeout: datetime.timedelta):
    """Pipeline parallelism's process groups (None with one stage), made by every rank alike."""
    if grid.pp == 1:
        return None
    from runtime.executor.pipeline_parallel import stage_groups

    return stage_groups(grid.tp, grid.pp, rank, timeout)


def _leave_groups(backend: str, together: bool = False) -> None:
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


def _bounded(fn, seconds: float) -> None:
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


class TensorParallelRunner(ModelRunner):
    """The executor over `tensor_parallel_size` ranks: rank 0 is this ModelRunner with its shard
    of the model; the other ranks follow its forwards and its block copies."""

    defers_sampling = False  # (a masked step samples at once: the deferral is measured on one GPU only)

    def __init__(self, model: LoadedModel, config, max_model_len: int, draft: LoadedModel | None = None):
        self.tp = TensorParallelRanks(model.config, model.params,
                                      Grid(config.tensor_parallel_size, config.pipeline_parallel_size),
                                      peer_sums=config.peer_sums and not config.enforce_eager)
        try:
            local_cfg, local_params = self.tp.local(model.params)  # rank 0's heads and units (and layers)
            super().__init__(dataclasses.replace(model, config=local_cfg, params=local_params), config,
                             max_model_len, draft)
            if self.tp.links is not None and self.tp.links.failures():  # (the start's warm-ups and captures)
                raise RuntimeError("peer sums: a pull gave up waiting for a rank's outputs while the engine started "
                                   "(its sums were wrong); start with peer_sums=False (--no-peer-sums)")
            self.pools.followers.append(self.tp)
            self.tp.ready()
        except BaseException:
            self.close()
            raise

    def _layer_functions(self, kernels):
        """Rank 0's layers, with the collectives that join the ranks."""
        return kernels._replace(layer_fns=self.tp.layer_functions(kernels.layer_fns))

    def _kv_bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """The largest of the ranks' bytes per block: every rank's pool has the same number of
        blocks, of its own heads and layers (KV heads the ranks do not divide, as 3 over 2,
        give rank 0 the fewest), and each must fit the budget."""
        grid = self.tp.grid
        return max(kv_bytes_per_block(rank_config(self.tp.cfg, grid, rank), self.config.block_size, kv_dtype)
                   for rank in range(grid.size))

    def _before_pools(self, kv_dtype: torch.dtype) -> None:
        """The ranks size their pools, and capture their graphs now, in step with rank 0's."""
        c = self.config
        self.tp.setup(RankSetup(self.num_blocks, self.num_cpu_blocks, c.block_size, kv_dtype, c.enforce_eager,
                                self._graph_sizes() if self.kernels.graphs else None, self._micro_batches()))

    def _micro_batches(self) -> int:
        """(A seam of pipeline_parallel.py's subclass.)"""
        return 1

    def _forward(self, batch: Batch):
        """The other ranks receive the batch first and decide alike (graph or eager)."""
        self.tp.forward(batch)
        with self.tp.watching(step=True):  # (the layers' collectives)
            return super()._forward(batch)

    def close(self) -> None:
        """Stop the other ranks (idempotent). The CUDA graphs go first, as on every rank: NCCL
        destroys a communicator only once no graph that captured its collectives lives (its
        commDestroySync waits on them), and a graph in flight is freed when it completes."""
        self.graphs = None
        gc.collect()
        self.tp.close()

# Every order starts with a fixed header of int64s: its kind and, for a forward (every step),
# each batch tensor's rows, columns (-1: 1-D) and dtype, so that the step's path pickles
# nothing; the batch's tensors then follow as one int64 broadcast (on CUDA over NCCL). A forward
# with its cut (FORWARD_CUT) sends the batch's Cut too. Any other order follows its kind as a
# pickled (kind, body). Over the control channel an order is one message (the header, then the
# cut's int64s or the pickle); over the control group (torchrun's ranks) a broadcast each.
FORWARD, OBJECT, FORWARD_CUT = 0, 1, 2
_DTYPES = (torch.int32, torch.int64)
HEADER = 1 + 3 * len(Batch._fields)
_OBJECT = np.int64(OBJECT).tobytes()


class Cut(NamedTuple):
    """A batch's query_start_loc and logits_indices on the host: the ranks that cut a step into
    micro-batches take them from rank 0 rather than from their GPU copies, whose reading would
    wait for the work queued before (a rank's host then launched a step only once its GPU had
    finished the last one)."""

    query_start_loc: list[int]
    logits_indices: list[int]


def _forward_header(batch: Batch, cut: bool = False) -> list[int]:
    fields = [FORWARD_CUT if cut else FORWARD]
    for t in batch:
        fields += (t.shape[0], t.shape[1] if t.dim() == 2 else -1, _DTYPES.index(t.dtype))
    return fields


def _layout(header: list[int]) -> list[tuple[int, int, int, int]]:
    """Per batch tensor of a forward's header: rows, columns (-1: 1-D), dtype index, elements."""
    return [(rows, cols, dtype, rows if cols < 0 else rows * cols)
            for rows, cols, dtype in zip(header[1:HEADER:3], header[2:HEADER:3], header[3:HEADER:3])]


def _unpack_batch(layout: list[tuple[int, int, int, int]], flat: torch.Tensor) -> Batch:
    """The Batch of a forward's `_layout` and its flattened tensors."""
    tensors, at = [], 0
    for rows, cols, dtype, n in layout:
        part = flat[at:at + n]
        tensors.append((part if cols < 0 else part.view(rows, cols)).to(_DTYPES[dtype]))
        at += n
    return Batch(*tensors)


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun started this process (its RANK and WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def serve_rank(cfg: ModelConfig, params: Params, grid: Grid | None = None) -> None:
    """What a rank other than 0 that torchrun started does: rank 0's orders until `stop`
    (`params`: the whole model, loaded by this process on its device; `grid`: the launch's
    tensor- and pipeline-parallel sizes, whose product is torchrun's world)."""
    rank, size = launched_rank()
    grid = grid or Grid(size)
    if grid.size != size:
        raise RequestError(f"tensor_parallel_size={grid.tp} x pipeline_parallel_size={grid.pp} is {grid.size} "
                           f"ranks, but torchrun started {size} (WORLD_SIZE): expected them equal",
                           param="tensor_parallel_size")
    rank_main(rank, size, Rendezvous(), cfg, params, params.device, grid)


def _receive(device: torch.device, control, channel: ChannelReader | None = None):
    """The next order, from the control channel where rank 0 gave one, else the control group:
    ("forward", (Batch on this rank's device, its Cut or None)) or a pickled (kind, body)."""
    if channel is not None:
        message = channel.read()
        if np.frombuffer(message, np.int64, count=1)[0] == OBJECT:
            return pickle.loads(memoryview(message)[len(_OBJECT):])
        header = np.frombuffer(message, np.int64).tolist()  # (then the Cut's, if any)
    else:
        received = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(received, src=0, group=control)
        header = received.tolist()
        if header[0] == OBJECT:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=control)
            return message[0]
    layout = _layout(header)
    cut = None
    if header[0] == FORWARD_CUT:  # (sizes: the batch's query_start_loc and logits_indices rows)
        seqs, rows = layout[Batch._fields.index("query_start_loc")][0], layout[-1][0]
        if channel is None:
            host = torch.empty(seqs + rows, dtype=torch.int64)
            dist.broadcast(host, src=0, group=control)
            header = [*header[:HEADER], *host.tolist()]
        cut = Cut(header[HEADER:HEADER + seqs], header[HEADER + seqs:])
    flat = torch.empty(sum(n for *_, n in layout), dtype=torch.int64, device=device)
    dist.broadcast(flat, src=0)
    return "forward", (_unpack_batch(layout, flat), cut)


def _named_channel(control, rank: int, size: int, spin: float = 0.0) -> ChannelWriter | ChannelReader | None:
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


def _join(rendezvous: Rendezvous, backend: str, rank: int, size: int):
    """A rank other than 0 joins the process group (having checked in at rank 0's store, when
    rank 0 started it); the control group returned, over which it waits for orders."""
    if rendezvous.host is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=TIMEOUT)
    else:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, size, is_master=False, timeout=TIMEOUT)
        store.set(f"ready/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE)


def rank_main(rank: int, size: int, rendezvous: Rendezvous, cfg: ModelConfig, params: Params,
              device: torch.device, grid: Grid | None = None, ring: torch.Tensor | None = None) -> None:
    """Rank `rank`'s process: its part of the model (its stage's layers, its shard of them), its KV
    pool, then rank 0's orders until `stop` (over the control channel in `ring` where rank 0
    started this rank, else over the control group)."""
    grid = grid or Grid(size)
    channel = None if ring is None else ChannelReader(ring.numpy(), rank - 1, spin=SPIN.get(device.type, SPIN["cpu"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    local, part = rank_part(cfg, params, grid, rank)
    del params  # (rank 0's whole weights: only this rank's part stays)
    part = map_params(lambda t: t.to(device), part)
    if device.type == "cuda":
        # Cutting rank 0's shared weights allocated this part's fused pieces (concatenations)
        # on rank 0's GPU; freed, they would stay in this process's cache there, memory rank 0
        # counts as its own when it sizes its KV pool.
        torch.cuda.empty_cache()
    backend = _backend(device)
    stopped = False  # (by rank 0's order: then every rank leaves the groups together)
    graphs = None
    try:
        control = _join(rendezvous, backend, rank, size)
        groups = _stage_groups(grid, rank, TIMEOUT)
        if rendezvous.host is None:  # (torchrun's rank: rank 0 names a channel if every rank is on its host)
            channel = _named_channel(control, rank, size, SPIN.get(device.type, SPIN["cpu"]))
        kind, setup = _receive(device, control, channel)
        if kind == "stop":  # (rank 0 failed to start: it stops the ranks before their setup)
            stopped = True
            return
        pools, step, graphs = _rank_model(rank, grid, cfg.vocab_size, local, part, setup, device, groups)
        orders = {"copy": pools.copy_blocks, "swap_out": pools.swap_out, "swap_in": pools.swap_in,
                  "ready": lambda _: dist.barrier(group=control)}
        with torch.inference_mode():
            while True:
                kind, body = _receive(device, control, channel)
                if kind == "stop":
                    stopped = True
                    break
                if kind != "forward":
                    orders[kind](body)
                elif graphs is not None and graphs.can_run(body[0]):
                    graphs.run(body[0])
                else:
                    step(*body)
    finally:  # (an error goes on to this process's stderr, whose tail rank 0 reports: RankLost)
        graphs = None  # (first: see TensorParallelRunner.close)
        gc.collect()
        _leave_groups(backend, together=stopped)


def _rank_model(rank: int, grid: Grid, vocab_size: int, local: ModelConfig, part: Params, setup: RankSetup,
                device: torch.device, groups):
    """A rank's KV pools, its step (a forward over a Batch and its Cut; a pipeline stage's over its
    micro-batches) and its CUDA graphs (None: eager)."""
    links = peer_links(local, grid, rank, part.dtype, device) if setup.peer_sums else None
    if links is not None:  # (first: rank 0 connects on sending the setup, and waits CONNECT for us)
        links.connect(dist.group.WORLD.group_name)
    kernels = kernels_for(local, device, setup.block_size, eager=setup.eager, params=part, kv_dtype=setup.kv_dtype)
    fns = rank_layer_functions(kernels.layer_fns, grid, rank, vocab_size, None if groups is None else groups.tp, links)
    pools = KVPools(local, setup.num_blocks, setup.num_cpu_blocks, setup.block_size, setup.kv_dtype, device)

    def step(batch: Batch, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        return (forward(part, pools.kv, batch, local, kernels.attention, fns, logits_dtype=None, hidden=hidden),)

    if grid.pp > 1:  # (its micro-batches' graphs, if any, are its stage step's: sends and receives between them)
        from nanoinfer.parallel.pipeline import Stage
        from runtime.executor.pipeline_parallel import (
            capture_stage,
            graph_or_eager,
            stage_step,
        )

        def compute(batch: Batch, hidden: torch.Tensor | None) -> torch.Tensor:
            return step(batch, hidden)[0]

        if kernels.graphs and setup.graphs is not None:  # (one rank a stage: see pipeline_parallel.py)
            compute = graph_or_eager(compute, capture_stage(compute, Stage(grid.place(rank)[0], grid.pp),
                                                            setup.graphs, local.hidden_size, part.dtype, device))
        return pools, stage_step(compute, grid.tp, grid.pp, rank, groups, setup.micro_batches, local, part.dtype,
                                 device), None
    graphs = None
    # (rank 0 captures the same buckets in the same order, at start and on first use: their collectives meet)
    if setup.graphs is not None:
        graphs = StepGraphs(step, device, **setup.graphs._asdict())
        graphs.capture()
    return pools, lambda batch, cut: step(batch), graphs
