"""Pipeline stages: which layers each of `size` stages holds, and a stage's part of the weights.

A stage is the same pure forward (nanoinfer/model/decoder.py) over a run of the layers: the first
stage embeds the batch's tokens, the last one holds the final norm and the LM head, and each
stage between hands its activations [tokens, hidden] to the next. Every stage keeps a KV pool
for its own layers only. The first stages take one more layer where they don't divide evenly:
the last stage also computes the LM head, as heavy as a few layers in large-vocabulary models.

A step's batch is cut into micro-batches of whole sequences (`split_batch`) so that the stages
overlap: the runtime's stage loop is runtime/executor/pipeline_parallel.py.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig
from nanoinfer.errors import RequestError
from nanoinfer.backends.host_copy import to_device_packed
from nanoinfer.model.decoder import Params


class Stage(NamedTuple):
    index: int  # 0: embeds the tokens
    count: int  # index count - 1: computes the logits

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def stage_layers(num_layers: int, stage: Stage) -> range:
    """The layers `stage` computes, in order (every stage holds at least one)."""
    if not 1 <= stage.count <= num_layers:
        raise RequestError(f"pipeline_parallel_size={stage.count} for a model of {num_layers} layers: expected "
                           f"1 to {num_layers} stages (a stage holds whole layers)", param="pipeline_parallel_size")
    per, extra = divmod(num_layers, stage.count)
    start = stage.index * per + min(stage.index, extra)
    return range(start, start + per + (stage.index < extra))


def stage_config(cfg: ModelConfig, stage: Stage) -> ModelConfig:
    """The config a stage's forward and KV pool see: its layers only."""
    if cfg.architecture == "nanochat" and stage.count > 1:  # (its own forward: value embeddings across layers)
        raise RequestError("pipeline parallelism runs the transformer of nanoinfer/model/decoder.py; a nanochat model "
                           "runs whole (pipeline_parallel_size=1)", param="pipeline_parallel_size")
    layers = stage_layers(cfg.num_layers, stage)
    windowed = None if cfg.windowed_layers is None else tuple(cfg.windowed_layers[i] for i in layers)
    return dataclasses.replace(cfg, num_layers=len(layers), windowed_layers=windowed)


def stage_params(params: Params, cfg: ModelConfig, stage: Stage) -> Params:
    """A stage's weights: its layers, the embedding on the first stage, the LM head on the last."""
    layers = stage_layers(cfg.num_layers, stage)
    return dataclasses.replace(params, layers=params.layers[layers.start:layers.stop],
                               embed=params.embed if stage.first else None,
                               lm_head=params.lm_head if stage.last else None)


class MicroBatches(NamedTuple):
    """A step's batch cut by sequences into micro-batches, which the stages pipeline: stage s
    computes micro-batch m while stage s + 1 computes m - 1."""

    batches: tuple[Batch, ...]
    # Rows of the micro-batches' logits, concatenated in order, that give the batch's logits
    # rows in its own order (None: they are in order already, as the model runner builds them).
    restore: torch.Tensor | None

    def logits_rows(self) -> list[int]:
        return [b.logits_indices.shape[0] for b in self.batches]


def split_batch(batch: Batch, parts: int, query_start_loc: list[int] | None = None,
                logits_indices: list[int] | None = None) -> MicroBatches:
    """`batch` as at most `parts` micro-batches of whole sequences, each at least one, cut where
    their tokens come closest to equal shares (a long prefill chunk may stand alone).
    `query_start_loc` and `logits_indices`: the batch's, on the host, where the caller has them
    (reading them off a GPU waits for the work queued before). Sequences never read each
    other's keys and values within a step, so the micro-batches run in any order."""
    if parts <= 1 or batch.query_start_loc.shape[0] <= 2:  # (one micro-batch: the step itself, no copies)
        return MicroBatches((batch,), None)
    qsl = batch.query_start_loc.tolist() if query_start_loc is None else list(query_start_loc)
    wanted = batch.logits_indices.tolist() if logits_indices is None else list(logits_indices)
    seqs, total = len(qsl) - 1, qsl[-1]
    parts = max(1, min(parts, seqs))
    cuts = [0]  # sequence index where each micro-batch starts
    for k in range(1, parts):  # (each part keeps one sequence at least, and leaves one for each after it)
        cuts.append(bisect.bisect_left(qsl, total * k / parts, cuts[-1] + 1, seqs - (parts - k)))
    cuts.append(seqs)
    token_cuts = [qsl[c] for c in cuts]
    # Each logits row goes with the micro-batch holding its token; `order`: the rows' indices in micro-batch order.
    part_of = [bisect.bisect_right(token_cuts, i) - 1 for i in wanted]
    order = sorted(range(len(wanted)), key=part_of.__getitem__)
    rows = [[wanted[j] - token_cuts[m] for j in order if part_of[j] == m] for m in range(parts)]
    in_order = order == sorted(order)
    restore = np.empty(len(order), dtype=np.int64)
    restore[order] = np.arange(len(order))
    # (one non-blocking copy: a blocking one would wait for the device's queued work)
    *rows_t, restore_t = to_device_packed([*rows, restore], batch.logits_indices.dtype, batch.input_ids.device)
    batches = []
    for m in range(parts):
        s0, s1, t0, t1 = cuts[m], cuts[m + 1], token_cuts[m], token_cuts[m + 1]
        batches.append(Batch(batch.input_ids[t0:t1], batch.positions[t0:t1], batch.slot_mapping[t0:t1],
                             batch.block_tables[s0:s1], batch.seq_lens[s0:s1],
                             batch.query_start_loc[s0:s1 + 1] - t0, rows_t[m]))
    return MicroBatches(tuple(batches), None if in_order else restore_t)
