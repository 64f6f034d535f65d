"""Pipeline stages: which layers each of `size` stages holds, and a stage's part of the weights.

A stage is the same pure forward (nanoinfer/model.py) over a run of the layers: the first
stage embeds the batch's tokens, the last one holds the final norm and the LM head, and each
stage between hands its activations [tokens, hidden] to the next. Every stage keeps a KV pool
for its own layers only. The first stages take one more layer where they don't divide evenly:
the last stage also computes the LM head, as heavy as a few layers in large-vocabulary models.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from nanoinfer.config import ModelConfig
from nanoinfer.errors import RequestError
from nanoinfer.model import Params


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
        raise RequestError("pipeline parallelism runs the transformer of nanoinfer/model.py; a nanochat model "
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
