"""Pipeline stages on the ranks: their process groups and point-to-point links, a stage's step over its
micro-batches (receive, compute, send), and its CUDA graphs. Rank 0's runner is pipeline_parallel.py's.
"""

from __future__ import annotations

import datetime
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from nanoinfer.backends.cuda.graphs import GraphSizes, StepGraphs
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.parallel.pipeline import MicroBatches, Stage, split_batch
from runtime.executor.tp_orders import Cut


class StageGroups(NamedTuple):
    """A rank's process groups besides the default one."""

    tp: object | None  # its stage's ranks, for their all-reduces (None: one rank a stage)
    logits: object | None  # rank 0 and the last stage's first rank (None: a rank that is neither)


def stage_groups(tp: int, pp: int, rank: int, timeout: datetime.timedelta) -> StageGroups:
    """Every rank makes every group, in the same order (torch.distributed's rule), and keeps its own."""
    mine = None
    if tp > 1:
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if rank // tp == stage:
                mine = group
    last = (pp - 1) * tp
    logits = dist.new_group([0, last], timeout=timeout)
    return StageGroups(mine, logits if rank in (0, last) else None)


class Links(NamedTuple):
    """Where a rank's stage input comes from and its output goes (ranks of the default group)."""

    source: int | None  # the previous stage's rank of the same shard (None: the first stage embeds the tokens)
    target: int | None  # the next stage's rank of the same shard (None: the last stage)
    logits: int | None  # the last stage's first rank sends its logits to rank 0 (else None)


def links(tp: int, pp: int, rank: int) -> Links:
    stage, shard = divmod(rank, tp)
    return Links(rank - tp if stage > 0 else None, rank + tp if stage < pp - 1 else None,
                 0 if stage == pp - 1 and shard == 0 else None)


Compute = Callable[[Batch, "torch.Tensor | None"], torch.Tensor]  # a micro-batch, its input activations -> output


def capture_stage(step: Compute, stage: Stage, sizes: GraphSizes, hidden_size: int, dtype: torch.dtype,
                  device: torch.device) -> StepGraphs:
    """CUDA graphs of a stage's forward `step` at one GPU's sizes: each takes the batch and,
    after the first stage, the activations [tokens, hidden_size] in a static buffer; each
    returns activations per token, or on the last stage the logits at the logits rows."""
    graphs = StepGraphs(lambda batch, hidden=None: (step(batch, hidden),), device, **sizes._asdict(),
                        stage_input=None if stage.first else (hidden_size, dtype), per_token=not stage.last)
    graphs.capture()
    return graphs


def graph_or_eager(step: Compute, graphs: StepGraphs | None) -> Compute:
    """A stage's forward of a micro-batch: a replay of `graphs` where one fits it, else `step`."""
    if graphs is None:
        return step

    def compute(batch: Batch, hidden: torch.Tensor | None) -> torch.Tensor:
        if not graphs.can_run(batch):
            return step(batch, hidden)
        # (a copy: the graph's output is its pool's memory, which the next micro-batch's replay
        # overwrites while the send of this one may still be reading it)
        return graphs.run(batch, hidden=hidden)[0].clone()

    return compute


def run_stage(compute: Compute, micro: MicroBatches, link: Links, groups: StageGroups, hidden_size: int,
              dtype: torch.dtype, device: torch.device) -> list:
    """This rank's stage over the micro-batches in order: each one's activations received (after
    the first stage), computed, and sent on without waiting for the send. Returns the sends in
    flight, each with its tensor (which must outlive it)."""
    sends = []
    for mb in micro.batches:
        hidden = None
        if link.source is not None:
            hidden = torch.empty(mb.num_tokens, hidden_size, dtype=dtype, device=device)
            dist.recv(hidden, src=link.source)
        out = compute(mb, hidden).contiguous()
        if link.target is not None:
            sends.append((dist.isend(out, dst=link.target), out))
        elif link.logits is not None and out.shape[0]:
            sends.append((dist.isend(out, dst=link.logits, group=groups.logits), out))
    return sends


def stage_step(compute: Compute, tp: int, pp: int, rank: int, groups: StageGroups, micro_batches: int,
               cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Callable[[Batch, Cut | None], None]:
    """A rank other than 0: its step over the Batch that rank 0 broadcast, cut where rank 0's Cut
    says (None: where the batch's own tensors say)."""
    link = links(tp, pp, rank)

    def step(batch: Batch, cut: Cut | None) -> None:
        micro = split_batch(batch, micro_batches, *(cut or ()))
        for work, _ in run_stage(compute, micro, link, groups, cfg.hidden_size, dtype, device):
            work.wait()

    return step
