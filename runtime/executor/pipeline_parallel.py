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

import numpy as np
import torch
import torch.distributed as dist

from nanoinfer.backends.cuda.graphs import GraphSizes
from nanoinfer.model.batch import Batch
from nanoinfer.parallel.pipeline import Stage, split_batch
from nanoinfer.sampling.sampler import greedy_and_finite
from runtime.executor.model_runner import ForwardOutput
from runtime.executor.pp_stages import capture_stage, graph_or_eager, links, run_stage
from runtime.executor.sample_stream import SampleStream
from runtime.executor.tensor_parallel import TensorParallelRunner
from runtime.executor.tp_orders import Cut


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
