"""The grid of tensor- and pipeline-parallel ranks: where each rank sits, its part of the config, the weights
and the layer functions, and the NVLink peer links of one-token sums.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import Params
from nanoinfer.parallel.shards import Shard, check_shardable, layer_functions, shard_config, shard_params

log = logging.getLogger("nanoinfer.tensor_parallel")


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
    elif not peers_reach(device, grid.size):
        why = "these GPUs cannot all reach each other's memory"
    elif not links.first_in_process():
        why = ("an engine of this process connected them before, and torch's symmetric memory meets new ranks "
               "once a process (nanoinfer.backends.cuda.peer_sum)")
    if why is None:
        return links
    log.warning("peer sums: %s; this engine sums with NCCL", why)
    return None


def check_grid(cfg: ModelConfig, grid: Grid) -> None:
    """RequestError naming what keeps `cfg` from running over `grid`, before any rank starts."""
    if grid.tp > 1 or grid.pp == 1:
        check_shardable(cfg, grid.tp)
    if grid.pp > 1:
        from nanoinfer.parallel.pipeline import Stage, stage_config

        stage_config(cfg, Stage(0, grid.pp))


def peers_reach(device: torch.device, size: int) -> bool:
    """Whether the GPUs of ranks 0..size-1 (from `device` on) can each access the others' memory."""
    first = device.index or 0
    gpus = range(first, first + size)
    return first + size <= torch.cuda.device_count() and all(
        torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun started this process (its RANK and WORLD_SIZE)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
