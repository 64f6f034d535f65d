"""DeviceModel: a model made ready on its device — kernels prepared, KV pools, CUDA graphs, its logits.

What the model runner (the target) and the draft runner (speculative decoding's draft) share:
each picks and prepares its device's kernels for its model, allocates its KV pools, runs its
forward over a Batch, and captures CUDA graphs of that forward where the kernels allow them.
"""

from __future__ import annotations

import dataclasses

import torch

from nanoinfer.model.batch import Batch
from nanoinfer.backends.choose import forward_of, kernels_for, prepare
from nanoinfer.model.kv_cache import kv_dtype
from nanoinfer.loaders import LoadedModel
from runtime.engine_config import EngineConfig
from runtime.executor import host_heap
from runtime.executor.kv_pools import KVPools


class DeviceModel:
    def __init__(self, model: LoadedModel, config: EngineConfig):
        self.model, self.config, self.cfg = model, config, model.config
        self.device = model.params.device
        self.block_size = config.block_size
        self.kv_dtype = kv_dtype(model.params.dtype, config.kv_cache_dtype)
        if self.device.type == "cpu":  # (each op's buffers reused, not faulted in afresh)
            host_heap.keep_step_buffers()
        self.kernels = self._layer_functions(kernels_for(self.cfg, self.device, config.block_size,
                                                         eager=config.enforce_eager, params=model.params,
                                                         kv_dtype=self.kv_dtype,
                                                         deterministic=config.deterministic))
        prepare(self.kernels, model.params, self.cfg.vocab_size)
        self.pools = self.kv = self.graphs = None

    def release(self) -> None:
        """Drop what holds the device's memory — the weights (the model keeps its config and tokenizer), the prepared
        kernels, the KV pools, the CUDA graphs — so that a closed engine gives its memory back (issue 64)."""
        model = getattr(self, "model", None)  # (a start that failed before it was set closes too)
        self.model = None if model is None else dataclasses.replace(model, params=None)
        self.kernels = self.attention = self.pools = self.kv = self.graphs = None

    def _layer_functions(self, kernels):
        """The layers' functions as the kernels give them (tensor parallelism adds its collectives)."""
        return kernels

    def _allocate(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.pools = KVPools(self.cfg, num_blocks, num_cpu_blocks, self.block_size, self.kv_dtype, self.device)
        self.kv = self.pools.kv

    def _capture(self, **sizes) -> None:
        """CUDA graphs of `_eager_forward` at `sizes` (nanoinfer/backends/cuda/graphs.py), where the kernels allow them."""
        if self.kernels.graphs:
            from nanoinfer.backends.cuda.graphs import StepGraphs

            self.graphs = StepGraphs(self._eager_forward, self.device, **sizes)
            self.graphs.capture()

    def _forward_logits(self, batch: Batch) -> torch.Tensor:
        """The model's logits at the batch's logits rows (its dtype), the batch's KV written."""
        k = self.kernels
        return forward_of(self.cfg)(self.model.params, self.kv, batch, self.cfg, k.attention, k.layer_fns,
                                    logits_dtype=None)

    def _eager_forward(self, batch: Batch):
        raise NotImplementedError
