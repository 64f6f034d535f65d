"""Pipeline parallelism: the model's layers in stages over ranks, a step's sequences through them as micro-batches.

The ranks form a grid (tensor_parallel.Grid): `pp` stages of `tp` ranks each, rank = stage * tp
+ shard. Each stage holds its run of the layers (nanoinfer/parallel/pipeline.py; the first the
embedding, the last the final norm and the LM head), its ranks a shard of them each with
their own all-reduces (a process group per stage), and a KV pool for its own layers only. The
processes, the orders and the faults are tensor parallelism's (tensor_parallel.py): rank 0
broadcasts each step's Batch to every rank; then every rank cuts it alike into micro-batches
of whole sequences (`split_batch`), and each stage, micro-batch after micro-batch, receives
the activations [tokens, hidden] from its shard's rank in the stage before (point to point:
gloo on the CPU, NCCL on CUDA), computes, and sends them on without waiting, so that stage s
works on micro-batch m while stage s + 1 works on m - 1. The last stage's first rank sends
the logits to rank 0 (a group of their own: on NCCL, point-to-point operations within one
communicator run in order, and logits coming back against activations going out would wait
on each other), which samples as with one rank.

Within a step the stages overlap but for the pipeline's fill and drain: with M micro-batches
over P stages, each stage idles about (P - 1) / (M + P - 1) of the step. With async scheduling
steps overlap too: the engine keeps two steps of disjoint sequences in flight
(`steps_in_flight`, runtime/engine/virtual_engines.py), and on CUDA rank 0 receives and samples
a step's logits on a side stream (sample_stream.py), so that its main stream computes stage 0
of the next step while the last stage computes this one; the steps then fill the stages
themselves, and each is one micro-batch unless `pipeline_micro_batches` says otherwise. Rank 0 neither waits on its main
stream for its sends nor for the batch's broadcast (the side stream does): the other ranks
take the broadcast only once their GPU is done with the step before.

On CUDA, where a stage has one rank, it computes a micro-batch by replaying a CUDA graph of its
forward (nanoinfer/backends/cuda/graphs.py: one per padded micro-batch size, as one GPU captures one per
batch size; the layer parts' kernels inside), and the sends and receives stay outside, eager
NCCL calls between replays: the received activations are copied into the graph's static input,
and its output copied out before it is sent on (the next replay reuses that memory while the
send may still be reading it). A micro-batch no graph fits runs eagerly. Stages of several
ranks run eagerly (the runner turns enforce_eager on): their all-reduce over the stage's
process group was a plain call that Dynamo traced into when the layer parts were compiled; they
are not now (nanoinfer.backends.choose), but graphs of such stages are untried.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.backends.cuda.graphs import GraphSizes, StepGraphs
from nanoinfer.parallel.pipeline import MicroBatches, Stage, split_batch
from nanoinfer.sampling.sampler import greedy_and_finite
from runtime.executor.model_runner import ForwardOutput
from runtime.executor.sample_stream import SampleStream
from runtime.executor.tensor_parallel import Cut, TensorParallelRunner


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


class PipelineParallelRunner(TensorParallelRunner):
    """The executor over `pipeline_parallel_size` stages (of `tensor_parallel_size` ranks each):
    rank 0 is this ModelRunner with the first stage's layers (its shard of them); it feeds the
    stages and samples the logits the last one sends back."""

    def __init__(self, model, config, max_model_len: int, draft=None):
        if model.params.device.type == "cuda" and config.tensor_parallel_size > 1 and not config.enforce_eager:
            config = dataclasses.replace(config, enforce_eager=True)  # (see the module's docstring)
        self._step_input = None  # the step being launched: its layout on the host
        # Two steps of disjoint sequences in flight, so that stage 0 computes one while the last
        # stage computes the other; speculative decoding reads each step before planning the next.
        # (2x H100, throughput workload: the 8B shape 8,205 tok/s against 6,060 one step at a
        # time; Qwen3-0.6B, whose step rank 0's host bounds, 14,585 against 18,151.)
        overlap = config.pipeline_overlap
        self.steps_in_flight = 2 if overlap and config.speculative_config is None else 1
        super().__init__(model, config, max_model_len, draft)
        grid = self.tp.grid
        self.link = links(grid.tp, grid.pp, 0)
        self.sampling = SampleStream(self.device, enabled=overlap)
        self.last = (grid.pp - 1) * grid.tp

    def _micro_batches(self) -> int:
        """With two steps in flight the steps themselves fill the stages: one micro-batch each
        (cut further, each stage reads its weights once more per micro-batch for nothing;
        measured on 2x H100, 8B shape: 7,924 tok/s uncut against 4,837 cut in two)."""
        if self.config.pipeline_micro_batches:
            return self.config.pipeline_micro_batches
        return 1 if self.steps_in_flight > 1 else self.tp.grid.pp

    def _capture(self, **sizes) -> None:
        """Graphs of the first stage's forward (the other ranks capture their stages' alike)."""
        self.graphs = capture_stage(self._first_stage, Stage(0, self.tp.grid.pp), GraphSizes(**sizes),
                                    self.cfg.hidden_size, self.model.params.dtype, self.device)

    def _first_stage(self, batch: Batch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0's stage: the batch's tokens embedded and through its layers."""
        return self._forward_logits(batch)

    def launch(self, inp, *args, **kwargs):
        """ModelRunner's launch: its inputs and stage 0 on the main stream, the rest on the side
        one from `_forward` on (sample_stream.py)."""
        self._step_input = inp
        seq_ids = frozenset(c.seq.seq_id for c in inp.chunks)
        self.sampling.before_launch(seq_ids, self.batch.joining)
        try:
            return super().launch(inp, *args, **kwargs)
        finally:
            self._step_input = None
            self.sampling.done(seq_ids.union(seq.seq_id for seq, _ in inp.samplers))  # (forks sample too)

    def _build(self, inp, draft_tokens):
        built = super()._build(inp, draft_tokens)
        self.sampling.hand_over(*built[2])  # (the sampler's rows and steps: read by the sampling)
        return built

    def _cut(self, batch: Batch) -> Cut:
        """The step's layout on the host, where the launch gave it (reading a GPU's index tensors
        back would wait for the step before), for every rank to cut its micro-batches alike."""
        inp = self._step_input
        qsl = None if inp is None else np.concatenate([[0], np.cumsum([c.num_tokens for c in inp.chunks])]).tolist()
        if qsl is None or qsl[-1] != batch.num_tokens:  # (not the launch's batch: its own tensors say)
            return Cut(batch.query_start_loc.tolist(), batch.logits_indices.tolist())
        return Cut(qsl, list(inp.logits_rows))

    def _forward(self, batch: Batch) -> ForwardOutput:
        """Every rank receives the batch and its cut; rank 0 computes the first stage of each
        micro-batch, then receives their logits from the last stage."""
        cut = self._cut(batch)
        flat, broadcast = self.tp.forward(batch, cut)
        micro = split_batch(batch, self._micro_batches(), *cut)
        dtype, vocab = self.model.params.dtype, self.cfg.vocab_size
        with self.tp.watching(step=True):
            sends = run_stage(graph_or_eager(self._first_stage, self.graphs), micro, self.link,
                              self.tp.stage_groups, self.cfg.hidden_size, dtype, self.device)
            self.sampling.switch()  # (stage 0 is queued: the rest of the launch goes on the side stream)
            self.sampling.wait(broadcast, flat)
            for work, out in sends:
                self.sampling.wait(work, out)
            parts = []
            for rows in micro.logits_rows():
                part = torch.empty(rows, vocab, dtype=dtype, device=self.device)
                if rows:
                    dist.recv(part, src=self.last, group=self.tp.stage_groups.logits)
                parts.append(part)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if micro.restore is not None:
            self.sampling.hand_over(micro.restore)
            logits = logits.index_select(0, micro.restore)
        return ForwardOutput(logits, *greedy_and_finite(logits))
