"""Which kernels run a model on a device: its attention backend and its layer functions.

The one place that decides, per device. On CUDA: the Triton paged-attention kernels, the
Triton GEMV for batch-1 projections, the fused q/k-norm + RoPE + KV-write kernel, and
torch.compile'd dense layer parts (unless `eager`); CUDA graphs may then capture decode
steps. On the CPU: batched torch attention and eager layers. Each fast path is tested
against the reference backend (nanoinfer/attention/reference.py), which stays the oracle.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from nanoinfer.attention import AttentionBackend
from nanoinfer.config import ModelConfig
from nanoinfer.model import EAGER, LayerFunctions, compiled_layer_functions


class Kernels(NamedTuple):
    attention: AttentionBackend
    layer_fns: LayerFunctions
    graphs: bool  # decode steps may be captured in CUDA graphs


def attention_backend(cfg: ModelConfig, device: torch.device, block_size: int) -> AttentionBackend:
    if device.type == "cuda":
        from nanoinfer.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(cfg, device=device)
    from nanoinfer.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention(block_size)


def kernels_for(cfg: ModelConfig, device: torch.device, block_size: int, *, eager: bool = False) -> Kernels:
    attention = attention_backend(cfg, device, block_size)
    if device.type != "cuda" or eager:
        return Kernels(attention, EAGER, False)
    from nanoinfer.gemv import linear
    from nanoinfer.loaders.hub import cache_dir
    from nanoinfer.rope_write import rope_and_write

    # Keep Inductor's compiled kernels beside the models, so a second start is fast.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    return Kernels(attention, compiled_layer_functions(linear, rope_and_write), True)
