"""A rank other than 0: its loop over rank 0's orders until `stop` (`rank_main`, started by tp_rank.py or, under
torchrun, by `serve_rank`), and its model: KV pools, step and CUDA graphs.
"""

from __future__ import annotations

import gc
import pickle

import numpy as np
import torch
import torch.distributed as dist

from nanoinfer.backends.choose import kernels_for
from nanoinfer.backends.cuda.graphs import StepGraphs
from nanoinfer.errors import RequestError
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import Params, forward, map_params
from runtime.executor.control_channel import ChannelReader
from runtime.executor.kv_pools import KVPools
from runtime.executor.tp_grid import Grid, peer_links, rank_layer_functions, rank_part
from runtime.executor.tp_grid import launched_rank
from runtime.executor.tp_groups import (IDLE, SPIN, TIMEOUT, Rendezvous, backend_of, leave_groups, make_stage_groups,
                                        named_channel)
from runtime.executor.tp_orders import (FORWARD_CUT, HEADER, OBJECT, OBJECT_BYTES, Cut, RankSetup, layout_of,
                                        unpack_batch)


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
            return pickle.loads(memoryview(message)[len(OBJECT_BYTES):])
        header = np.frombuffer(message, np.int64).tolist()  # (then the Cut's, if any)
    else:
        received = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(received, src=0, group=control)
        header = received.tolist()
        if header[0] == OBJECT:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=control)
            return message[0]
    layout = layout_of(header)
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
    return "forward", (unpack_batch(layout, flat), cut)


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
    backend = backend_of(device)
    stopped = False  # (by rank 0's order: then every rank leaves the groups together)
    graphs = None
    try:
        control = _join(rendezvous, backend, rank, size)
        groups = make_stage_groups(grid, rank, TIMEOUT)
        if rendezvous.host is None:  # (torchrun's rank: rank 0 names a channel if every rank is on its host)
            channel = named_channel(control, rank, size, SPIN.get(device.type, SPIN["cpu"]))
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
        leave_groups(backend, together=stopped)


def _rank_model(rank: int, grid: Grid, vocab_size: int, local: ModelConfig, part: Params, setup: RankSetup,
                device: torch.device, groups):
    """A rank's KV pools, its step (a forward over a Batch and its Cut; a pipeline stage's over its
    micro-batches) and its CUDA graphs (None: eager)."""
    links = peer_links(local, grid, rank, part.dtype, device) if setup.peer_sums else None
    if links is not None:  # (first: rank 0 connects on sending the setup, and waits CONNECT for us)
        links.connect(dist.group.WORLD.group_name)
    kernels = kernels_for(local, device, setup.block_size, eager=setup.eager, params=part, kv_dtype=setup.kv_dtype,
                          deterministic=setup.deterministic)
    fns = rank_layer_functions(kernels.layer_fns, grid, rank, vocab_size, None if groups is None else groups.tp, links)
    pools = KVPools(local, setup.num_blocks, setup.num_cpu_blocks, setup.block_size, setup.kv_dtype, device)

    def step(batch: Batch, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        return (forward(part, pools.kv, batch, local, kernels.attention, fns, logits_dtype=None, hidden=hidden),)

    if grid.pp > 1:  # (its micro-batches' graphs, if any, are its stage step's: sends and receives between them)
        from nanoinfer.parallel.pipeline import Stage
        from runtime.executor.pp_stages import (
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
