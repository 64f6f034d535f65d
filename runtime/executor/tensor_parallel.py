"""Tensor-parallel ranks for the engine: worker processes that run each forward beside rank 0.

The engine stays one process (rank 0: scheduler, sampler, its own shard of the model). For
`tensor_parallel_size` N it spawns ranks 1..N-1, one process each; every rank holds its shard
of the weights (nanoinfer/tensor_parallel.py) and a KV pool of its own heads, indexed by
rank 0's block tables. Rank 0 tells the others what to do, in the order it does it:

- `forward`: before each of its forwards, the step's Batch (a header with the shapes over
  the control group, then the tensors in one broadcast). Every rank runs the same forward, so
  their collectives (an all-reduce after each row-parallel projection, the vocab-parallel
  embedding, the gathered logits) meet; only rank 0 samples.
- `copy`, `swap_out`, `swap_in`: the block copies of copy-on-write and preemption.
- `stop`: at close; the ranks leave their loop and exit. They are daemons, and each watches
  its parent besides: none outlives the engine's process, however it ends. A rank that exits
  on its own fails the engine (RankLost, fatal) at the next message rather than at a
  collective's timeout.

Ranks take the weights from rank 0 (shared memory on the CPU) and shard them themselves.
Across hosts, torchrun starts every rank instead (each loads the model itself: `serve_rank`),
and they meet at its rendezvous (env://).
The collectives are torch.distributed's: gloo on the CPU, NCCL on CUDA, with a gloo group for
the control messages. The default process group is the process's: one tensor-parallel engine
per process at a time. On CUDA every rank captures the same graphs as rank 0, its
collectives inside (NCCL's kernels capture like any other), and replays the one rank 0
replays: the decision follows from the batch, which every rank has.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import tempfile
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoinfer.batch import Batch
from nanoinfer.config import ModelConfig
from nanoinfer.errors import DeviceLost, RequestError
from nanoinfer.graphs import GraphSizes, StepGraphs
from nanoinfer.kernels import kernels_for, mark_weights_static
from nanoinfer.loaders import LoadedModel
from nanoinfer.model import Params, forward, map_params
from nanoinfer.tensor_parallel import (
    Shard,
    check_shardable,
    layer_functions,
    shard_config,
    shard_params,
)
from runtime.executor.kv_pools import KVPools
from runtime.executor.model_runner import ModelRunner

log = logging.getLogger("nanoinfer.tensor_parallel")

# Long enough for the slowest step (a long CPU prefill); a rank that died ends the others then.
TIMEOUT = datetime.timedelta(minutes=10)


class RankLost(DeviceLost):
    """A tensor-parallel rank's process is gone: the model is incomplete, nothing can run."""


class RankSetup(NamedTuple):
    """What a rank needs besides the weights, sent once rank 0 has sized its KV pool."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    eager: bool  # kernels_for's (enforce_eager): no compiled or fused layers, no graphs
    graphs: GraphSizes | None  # the CUDA graphs rank 0 captures, which every rank captures alike


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the GPUs after rank 0's (`device`: cuda:k gives ranks cuda:k..k+size-1)."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


class TensorParallelRanks:
    """Rank 0's side: spawns the other ranks, joins them in a process group, and sends them
    each step's work."""

    def __init__(self, cfg: ModelConfig, params: Params, size: int):
        check_shardable(cfg, size)
        self.cfg, self.size = cfg, size
        device = params.device
        self._init_file, self.procs = None, []
        launched = launched_rank()
        if launched is not None:  # torchrun started every rank: they meet at its rendezvous
            if launched != (0, size):
                raise RequestError(f"tensor_parallel_size={size}, but torchrun started this process as rank "
                                   f"{launched[0]} of {launched[1]} (RANK, WORLD_SIZE): expected rank 0 of {size}",
                                   param="tensor_parallel_size")
            init = "env://"
        else:
            self._init_file = tempfile.NamedTemporaryFile(prefix="nanoinfer-tp-", delete=False).name
            os.unlink(self._init_file)  # (the rendezvous creates it)
            init = f"file://{self._init_file}"
            ctx = mp.get_context("spawn")
            self.procs = [ctx.Process(target=_rank_main, name=f"nanoinfer-tp-rank{rank}", daemon=True,
                                      args=(rank, size, init, cfg, params, _rank_device(device, rank), os.getpid()))
                          for rank in range(1, size)]
            for p in self.procs:
                p.start()
        try:
            dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=size, timeout=TIMEOUT)
            self.control = dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else None
        except BaseException:  # (no group to stop them through: the ranks just started go now)
            for p in self.procs:
                p.kill()
            raise
        self.shard = Shard(0, size)
        self.closed = False

    def local(self, params: Params) -> tuple[ModelConfig, Params]:
        """Rank 0's view of the model and its part of the weights."""
        return shard_config(self.cfg, 0, self.size), shard_params(params, self.cfg, 0, self.size)

    def layer_functions(self, base):
        return layer_functions(base, self.shard, self.cfg.vocab_size)

    def setup(self, setup: RankSetup) -> None:
        self._send(("setup", setup))

    def forward(self, batch: Batch) -> None:
        """Before rank 0's own forward over `batch`: the other ranks receive it and start theirs
        (a graph's replay where rank 0's graphs take it: theirs are the same)."""
        self._check_ranks()
        dist.broadcast(_forward_header(batch), src=0, group=self.control)
        dist.broadcast(torch.cat([t.reshape(-1).to(torch.int64) for t in batch]), src=0)

    def copy_blocks(self, copies) -> None:
        self._send(("copy", copies))

    def swap_out(self, copies) -> None:
        self._send(("swap_out", copies))

    def swap_in(self, copies) -> None:
        self._send(("swap_in", copies))

    def close(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send(("stop", None))
        except Exception:  # noqa: BLE001 - a rank already gone: the others are stopped below
            log.warning("stopping the tensor-parallel ranks: a rank was already gone")
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            if self._init_file is not None and os.path.exists(self._init_file):
                os.unlink(self._init_file)

    def _send(self, message) -> None:
        """An order other than a forward: (kind, body), pickled."""
        self._check_ranks()
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = OBJECT
        dist.broadcast(header, src=0, group=self.control)
        dist.broadcast_object_list([message], src=0, group=self.control)

    def _check_ranks(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():  # (a collective with it would wait for the timeout)
                raise RankLost(f"tensor-parallel rank {rank} exited (code {p.exitcode}): the engine cannot "
                               f"run the model without it")



class TensorParallelRunner(ModelRunner):
    """The executor over `tensor_parallel_size` ranks: rank 0 is this ModelRunner with its shard
    of the model; the other ranks follow its forwards and its block copies."""

    def __init__(self, model: LoadedModel, config, max_model_len: int, draft: LoadedModel | None = None):
        self.tp = TensorParallelRanks(model.config, model.params, config.tensor_parallel_size)
        try:
            local_cfg, local_params = self.tp.local(model.params)  # rank 0's heads and units
            super().__init__(dataclasses.replace(model, config=local_cfg, params=local_params), config,
                             max_model_len, draft)
            self.pools.followers.append(self.tp)
        except BaseException:
            self.close()
            raise

    def _layer_functions(self, kernels):
        """Rank 0's layers, with the collectives that join the ranks."""
        return kernels._replace(layer_fns=self.tp.layer_functions(kernels.layer_fns))

    def _before_pools(self, kv_dtype: torch.dtype) -> None:
        """The ranks size their pools, and capture their graphs now, in step with rank 0's."""
        c = self.config
        self.tp.setup(RankSetup(self.num_blocks, self.num_cpu_blocks, c.block_size, kv_dtype, c.enforce_eager,
                                self._graph_sizes() if self.kernels.graphs else None))

    def _forward(self, batch: Batch):
        """The other ranks receive the batch first and decide alike (graph or eager)."""
        self.tp.forward(batch)
        return super()._forward(batch)

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        self.tp.close()

# Every order starts with a fixed header of int64s over the control group: its kind and, for a
# forward (every step), each batch tensor's rows, columns (-1: 1-D) and dtype, so that the
# step's path pickles nothing; the batch's tensors then follow as one int64 broadcast (on
# CUDA over NCCL). Any other order follows its header as a pickled (kind, body).
FORWARD, OBJECT = 0, 1
_DTYPES = (torch.int32, torch.int64)
HEADER = 1 + 3 * len(Batch._fields)


def _forward_header(batch: Batch) -> torch.Tensor:
    fields = [FORWARD]
    for t in batch:
        fields += (t.shape[0], t.shape[1] if t.dim() == 2 else -1, _DTYPES.index(t.dtype))
    return torch.tensor(fields, dtype=torch.int64)


def _layout(header: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Per batch tensor of a forward's header: rows, columns (-1: 1-D), dtype index, elements."""
    return [(rows, cols, dtype, rows if cols < 0 else rows * cols)
            for rows, cols, dtype in header[1:].view(-1, 3).tolist()]


def _unpack_batch(layout: list[tuple[int, int, int, int]], flat: torch.Tensor) -> Batch:
    """The Batch of a forward's `_layout` and its flattened tensors."""
    tensors, at = [], 0
    for rows, cols, dtype, n in layout:
        part = flat[at:at + n]
        tensors.append((part if cols < 0 else part.view(rows, cols)).to(_DTYPES[dtype]))
        at += n
    return Batch(*tensors)


def _exit_with_parent(parent: int) -> None:
    """A rank whose engine process died (SIGKILL, SIGTERM without cleanup) exits too. Inside a
    collective gloo notices the closed peer by itself; this covers the rest (the rendezvous
    of a start that the engine did not live through would wait for its timeout)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun started this process (its RANK and WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def serve_rank(cfg: ModelConfig, params: Params) -> None:
    """What a rank other than 0 that torchrun started does: rank 0's orders until `stop`
    (`params`: the whole model, loaded by this process on its device)."""
    rank, size = launched_rank()
    _rank_main(rank, size, "env://", cfg, params, params.device, None)


def _receive(device: torch.device, control):
    """The next order: ("forward", Batch on this rank's device) or a pickled (kind, body)."""
    header = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(header, src=0, group=control)
    if header[0] == FORWARD:
        layout = _layout(header)
        flat = torch.empty(sum(n for *_, n in layout), dtype=torch.int64, device=device)
        dist.broadcast(flat, src=0)
        return "forward", _unpack_batch(layout, flat)
    message = [None]
    dist.broadcast_object_list(message, src=0, group=control)
    return message[0]


def _rank_main(rank: int, size: int, init: str, cfg: ModelConfig, params: Params, device: torch.device,
               parent: int | None) -> None:
    """Rank `rank`'s process: its shard, its KV pool, then rank 0's orders until `stop`."""
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=size, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else None
    try:
        local = shard_config(cfg, rank, size)
        shard = shard_params(params, cfg, rank, size)
        del params  # (rank 0's whole weights: only the shard stays)
        shard = map_params(lambda t: t.to(device), shard)
        kind, setup = _receive(device, control)
        if kind == "stop":  # (rank 0 failed to start: it stops the ranks before their setup)
            return
        kernels = kernels_for(local, device, setup.block_size, eager=setup.eager, params=shard,
                              kv_dtype=setup.kv_dtype)
        fns = layer_functions(kernels.layer_fns, Shard(rank, size), cfg.vocab_size)
        if kernels.graphs:
            mark_weights_static(shard)
        pools = KVPools(local, setup.num_blocks, setup.num_cpu_blocks, setup.block_size, setup.kv_dtype, device)
        orders = {"copy": pools.copy_blocks, "swap_out": pools.swap_out, "swap_in": pools.swap_in}

        def step(batch: Batch) -> tuple[torch.Tensor]:
            return (forward(shard, pools.kv, batch, local, kernels.attention, fns, logits_dtype=None),)

        graphs = None
        if setup.graphs is not None:  # (rank 0 captures the same buckets in the same order: their collectives meet)
            graphs = StepGraphs(step, device, **setup.graphs._asdict())
            graphs.capture()
        with torch.inference_mode():
            while True:
                kind, body = _receive(device, control)
                if kind == "stop":
                    break
                if kind != "forward":
                    orders[kind](body)
                elif graphs is not None and graphs.can_run(body):
                    graphs.run(body)
                else:
                    step(body)
    except Exception:  # noqa: BLE001 - reported; rank 0 sees this rank gone at its next message (RankLost)
        log.exception("tensor-parallel rank %d failed", rank)
        raise
    finally:
        dist.destroy_process_group()
