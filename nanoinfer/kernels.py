"""What runs a model: its family's forward (`forward_of`), and per device its kernels
(`kernels_for`: attention backend, layer functions, sampler draw).

The one place that decides, per family and per device. A family with a dataflow of its own
(nanochat) has its module imported only for a model of that family. On CUDA: the Triton paged-attention kernels, the
Triton GEMV for batch-1 projections (with the norms, SwiGLU and residual adds folded in:
nanoinfer.fused_layers), the fused q/k-norm + RoPE + KV-write kernel, torch.compile'd
dense layer parts and the sampler's random draw as a Triton kernel (nanoinfer.draw_triton),
unless `eager`; CUDA graphs may then capture steps. On the CPU: a packed (quantized) model's layers run
nanoinfer.cpu_layers (packed matmuls, the rest in a few C calls, unless `eager`); any other
model batched torch attention, eager layers and RoPE with the KV write in a few ops
(nanoinfer.rope_write_cpu). Where each op costs microseconds, fewer ops is the CPU's
fusion: torch.compile's per-call guards measured slower. Each
fast path is tested against its reference (nanoinfer/attention/reference.py for attention,
the eager functions for the compiled ones), which stays the oracle.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from nanoinfer.config import ModelConfig
from nanoinfer.model import EAGER, LayerFunctions, Params, compiled_layer_functions, forward, map_params

if TYPE_CHECKING:
    from nanoinfer.attention import AttentionBackend


def forward_of(cfg: ModelConfig) -> Callable:
    """`forward(params, kv, batch, cfg, backend, layer_fns, logits_dtype) -> logits` for `cfg`:
    the shared decoder's (nanoinfer/model.py: Llama, Mistral, Qwen2, Qwen3) or a dataflow of
    the family's own (nanochat)."""
    if cfg.architecture == "nanochat":
        from nanoinfer import nanochat

        return nanochat.forward
    return forward


class Kernels(NamedTuple):
    attention: AttentionBackend
    layer_fns: LayerFunctions
    graphs: bool  # steps may be captured in CUDA graphs
    draw: Callable | None = None  # the sampler's random draw, fused; None: nanoinfer.draw.random_draw, eager


def attention_backend(cfg: ModelConfig, device: torch.device, block_size: int) -> AttentionBackend:
    if device.type == "cuda":
        from nanoinfer.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(cfg, device=device)
    from nanoinfer.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention(block_size)


def kernels_for(cfg: ModelConfig, device: torch.device, block_size: int, *, eager: bool = False,
                params: Params | None = None, kv_dtype: torch.dtype | None = None) -> Kernels:
    """`params` and `kv_dtype` (the pool's) let the CPU pick its fused layers for a packed model."""
    if device.type != "cuda":
        from nanoinfer import cpu_layers, cpu_native

        lib = None
        if not eager and params is not None and cpu_layers.takes(params, kv_dtype or params.dtype):
            lib = cpu_native.library()
        if lib is not None:
            native = cpu_native.CpuNative(lib)
            return Kernels(cpu_layers.NativeAttention(block_size, native), cpu_layers.layer_functions(native),
                           False)
        from nanoinfer import rope_write_cpu

        return Kernels(attention_backend(cfg, device, block_size),
                       LayerFunctions(rope_and_write=rope_write_cpu.rope_and_write,
                                      rope_tables=rope_write_cpu.rope_tables), False)
    attention = attention_backend(cfg, device, block_size)
    if eager:
        return Kernels(attention, EAGER, False)
    from nanoinfer import fused_layers
    from nanoinfer.draw_triton import triton_draw
    from nanoinfer.gemv import linear
    from nanoinfer.hub import cache_dir
    from nanoinfer.rope_write import rope_and_write

    # Keep Inductor's compiled kernels beside the models, so a second start is fast.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    # (one token: the norms, SwiGLU and residual adds inside the GEMVs)
    parts = EAGER._replace(qkv_projection=fused_layers.qkv_projection,
                           attention_output_and_mlp=fused_layers.attention_output_and_mlp)
    return Kernels(attention, compiled_layer_functions(linear, rope_and_write, parts), True, triton_draw)


def mark_weights_static(params: Params) -> None:
    """Every weight's shape static to the compiler (see `prepare`)."""
    def static(t: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_static(t)
        return t

    map_params(static, params)  # (marks the tensors themselves; the copy it returns is dropped)


def prepare(kernels: Kernels, params: Params, vocab_size: int) -> None:
    """Before the first step, where the kernels compile: the weights' shapes are static to the
    compiler (with every size dynamic, a first step of 4,096 tokens made the QKV weight's
    4,096 rows equal to the token count, and the next step compiled again), and the sampler's
    Triton draw compiles now rather than at the first sampled step."""
    if not kernels.graphs:
        return
    mark_weights_static(params)
    probs = torch.full((1, vocab_size), 1.0 / vocab_size, device=params.device)
    zeros = torch.zeros(1, dtype=torch.int64, device=params.device)
    kernels.draw(probs, zeros, zeros)
