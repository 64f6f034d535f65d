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
WORLD_SIZE: `named_channel`); across hosts over a gloo group (the control group, which every
rank keeps for the `ready` barrier). A rank waits for orders without a timeout: an engine may idle.
The default process group is the process's: one tensor-parallel engine per process at a time.
With pipeline parallelism the ranks form a grid (`Grid`: stages of tensor-parallel ranks;
runtime/executor/pipeline_parallel.py runs the stages): the same processes, orders and faults.
On CUDA every rank captures the same graphs as rank 0, its collectives inside (NCCL's kernels
capture like any other), and replays the one rank 0 replays: the decision follows from the
batch, which every rank has.

Here: the runner and rank 0's side (`TensorParallelRanks`). Beside it: tp_grid.py (the grid, each rank's
part), tp_orders.py (the orders on the wire), tp_groups.py (process groups, timeouts, the channel),
tp_follower.py (a rank's loop), tp_processes.py (the ranks started and watched), tp_rank.py (their entry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import pickle
import threading

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from nanoinfer.errors import DeviceLost, RequestError
from nanoinfer.loaders import LoadedModel
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import Params
from nanoinfer.model.kv_cache import kv_bytes_per_block
from runtime.executor.control_channel import ChannelWriter, channel_bytes
from runtime.executor.model_runner import ModelRunner
from runtime.executor.tp_follower import launched_rank
from runtime.executor.tp_grid import Grid, check_grid, lead_peer_links, rank_config, rank_layer_functions, rank_part
from runtime.executor.tp_groups import (CONNECT, LEAVE_WAIT, RENDEZVOUS, SLOTS, SLOT_SIZE, TIMEOUT, abort_collectives,
                                        all_groups, backend_of, bounded, leave_groups, log, make_stage_groups,
                                        maybe_a_peer, named_channel, rank_device, report_lost, store_timeout)
from runtime.executor.tp_orders import HEADER, OBJECT, OBJECT_BYTES, Cut, RankSetup, forward_header
from runtime.executor.tp_processes import RankProcesses
RANK_MODULE = "runtime.executor.tp_rank"  # what a rank this engine starts runs (`python -m`)


class TensorParallelRanks:
    """Rank 0's side: starts the other ranks, joins them in a process group, and sends them
    each step's work."""

    channel: ChannelWriter | None = None  # the orders' way to the ranks this engine started (None: the control group)

    def __init__(self, cfg: ModelConfig, params: Params, grid: Grid | int, peer_sums: bool = False):
        grid = grid if isinstance(grid, Grid) else Grid(grid)
        check_grid(cfg, grid)
        self.cfg, self.grid, self.size = cfg, grid, grid.size
        size = grid.size
        device = params.device
        self.links = lead_peer_links(cfg, grid, params.dtype, device) if peer_sums else None
        self.backend = backend_of(device)
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
            self.stage_groups = make_stage_groups(grid, 0, TIMEOUT)
            self.channel = named_channel(self.control, 0, size)
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
                                    lambda rank: (cfg, params, rank_device(device, rank), self.grid, ring),
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
            self.stage_groups = make_stage_groups(self.grid, 0, RENDEZVOUS)
            if gloo:
                _set_pg_timeout(TIMEOUT)
            _set_pg_timeout(TIMEOUT, control)
            for group in all_groups(self.stage_groups):
                _set_pg_timeout(TIMEOUT, group)
        except BaseException as exc:  # (no group to stop them through: the ranks just started go now)
            lost = self.launch.wait_lost(2.0) if maybe_a_peer(exc) else None
            self.launch.stop(wait=0)
            bounded(lambda: leave_groups(self.backend), LEAVE_WAIT)
            if lost is not None:
                raise lost.lost(" while starting") from exc
            raise
        self.launch.watch(functools.partial(abort_collectives, all_groups(self.stage_groups)) if self.backend == "nccl"
                          else report_lost)
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
            with self.watching(), store_timeout(CONNECT):
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
            header = forward_header(batch, cut is not None)
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
                leave_groups(self.backend)
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
            bounded(lambda: leave_groups(self.backend, together=True), LEAVE_WAIT)
            lost = self.launch.stop()
        else:
            lost = self.launch.stop()
            sending.join(LEAVE_WAIT)
            # Last, with no peer left to wait for (NCCL's communicators are aborted, not destroyed).
            bounded(lambda: leave_groups(self.backend), LEAVE_WAIT)
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
            if self.launch is not None and maybe_a_peer(exc):
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
                self.channel.write(OBJECT_BYTES + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
                return
            header = torch.zeros(HEADER, dtype=torch.int64)
            header[0] = OBJECT
            dist.broadcast(header, src=0, group=self.control)
            dist.broadcast_object_list([message], src=0, group=self.control)


class TensorParallelRunner(ModelRunner):
    """The executor over `tensor_parallel_size` ranks: rank 0 is this ModelRunner with its shard
    of the model; the other ranks follow its forwards and its block copies."""

    defers_sampling = False  # (a masked step samples at once: the deferral is measured on one GPU only)

    def __init__(self, model: LoadedModel, config, max_model_len: int, draft: LoadedModel | None = None):
        if config.deterministic and config.tensor_parallel_size > 2 and model.params.device.type == "cuda":
            # (two ranks' sum is one rounding of x0 + x1 in any order; NCCL adds more in an order of its choosing)
            raise ValueError(f"deterministic=True with tensor_parallel_size={config.tensor_parallel_size} on CUDA: "
                             f"NCCL's sum over more than two GPUs follows its algorithm; expected at most 2")
        self.tp = TensorParallelRanks(model.config, model.params,
                                      Grid(config.tensor_parallel_size, config.pipeline_parallel_size),
                                      # (deterministic: one token's sum as more tokens' are, through NCCL)
                                      peer_sums=config.peer_sums and not config.enforce_eager
                                      and not config.deterministic)
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
                                self._graph_sizes() if self.kernels.graphs else None, self._micro_batches(),
                                deterministic=c.deterministic))

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
        super().close()
