"""What runs a model: its family's forward (`forward_of`), and per device its kernels
(`kernels_for`: attention backend, layer functions, sampler draw, grammar masks).

The one place that decides, per family and per device. A family with a dataflow of its own
(nanochat) has its module imported only for a model of that family. On CUDA: the Triton paged-attention kernels, the
Triton GEMV for batch-1 projections (with the norms, SwiGLU and residual adds folded in:
nanoinfer.backends.cuda.fused_layers), Triton row kernels for those steps at more tokens
(nanoinfer.backends.cuda.batched_layers), the fused q/k-norm + RoPE + KV-write kernel, and as Triton
kernels the sampler's random draw and the grammar masks' application to the logits
(nanoinfer.backends.cuda.draw_triton, nanoinfer.backends.cuda.bitmask_triton), unless `eager`; CUDA graphs may then capture
steps. Nothing is torch.compile'd: Dynamo and Inductor took most of a cold start. On the CPU:
a packed (quantized) model's layers run nanoinfer.backends.cpu.cpu_layers (packed matmuls, the rest in a few
C calls, unless `eager`) and its sampler's draw one C call (cpu_native's `random_draw`); any
other model batched torch attention, eager layers and RoPE with the KV write in a few ops
(nanoinfer.backends.cpu.rope_write_cpu). Where each op costs microseconds, fewer ops is the CPU's fusion:
torch.compile's per-call guards measured slower. Each fast path is tested against its
reference (nanoinfer/attention/reference.py for attention, nanoinfer.model.decoder's eager layer parts
for the fused ones, nanoinfer.sampling.draw.random_draw for the draws), which stays the oracle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import EAGER, LayerFunctions, Params, forward

if TYPE_CHECKING:
    from nanoinfer.attention import AttentionBackend


def forward_of(cfg: ModelConfig) -> Callable:
    """`forward(params, kv, batch, cfg, backend, layer_fns, logits_dtype) -> logits` for `cfg`:
    the shared decoder's (nanoinfer/model/decoder.py: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, Mixtral,
    Qwen3-MoE) or a dataflow of
    the family's own (nanochat)."""
    if cfg.architecture == "nanochat":
        from nanoinfer.model import nanochat

        return nanochat.forward
    return forward


class Kernels(NamedTuple):
    attention: AttentionBackend
    layer_fns: LayerFunctions
    graphs: bool  # steps may be captured in CUDA graphs
    draw: Callable | None = None  # the sampler's random draw, fused; None: nanoinfer.sampling.draw.random_draw, eager
    mask: Callable | None = None  # grammar masks onto the logits, fused; None: nanoinfer.structured.bitmasks.apply_bitmask
    # a step's greedy tokens and finite rows from its logits, in one call; None: nanoinfer.sampling.sampler's
    greedy: Callable | None = None


def attention_backend(cfg: ModelConfig, device: torch.device, block_size: int,
                      deterministic: bool = False) -> AttentionBackend:
    if device.type == "cuda":
        from nanoinfer.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(cfg, device=device, deterministic=deterministic)
    from nanoinfer.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention(block_size)


def fused_layers_lack(cfg: ModelConfig) -> str | None:
    """What of `cfg`'s dataflow the fused layers lack (the CPU's packed C layers and their attention, CUDA's
    batch-invariant parts), as one line; None: nothing. Such a model runs its layers' torch parts on the CPU (its
    matrices still packed). CUDA's own layer parts take every family: Gemma's sandwich norms and GeGLU in their
    row kernels, the Triton attention with Gemma 2's soft-cap, the experts in fused_moe's grouped kernels."""
    if cfg.attn_softcap is not None:
        return "attention logit soft-capping (Gemma 2's attn_logit_softcapping) is not in the fused layers"
    if cfg.sandwich_norms or cfg.hidden_act != "silu":
        return "Gemma's sandwich norms and GeGLU MLP are not in the fused layers"
    if cfg.num_experts:  # (the CPU runs nanoinfer/model/moe.py's reference in its torch layers)
        return "the mixture-of-experts MLP is not in the fused layers"
    return None


def kernels_for(cfg: ModelConfig, device: torch.device, block_size: int, *, eager: bool = False,
                params: Params | None = None, kv_dtype: torch.dtype | None = None,
                deterministic: bool = False) -> Kernels:
    """`params` and `kv_dtype` (the pool's) let the CPU pick its fused layers for a packed model.
    `deterministic`: on CUDA, the batch-invariant parts (nanoinfer.backends.cuda.invariant), with CUDA graphs
    unless `eager`; the CPU's kernels are batch-invariant already (tests/test_cpu_determinism.py)."""
    lacking = fused_layers_lack(cfg)
    if device.type == "cuda" and deterministic:
        return _invariant_kernels(cfg, device, block_size, eager, lacking, params)
    if device.type != "cuda":
        from nanoinfer.backends.cpu import cpu_layers
        from nanoinfer.backends.cpu import cpu_native

        lib = None
        if not eager and params is not None and lacking is None and cpu_layers.takes(params, kv_dtype or params.dtype):
            lib = cpu_native.library()
        if lib is not None:
            native = cpu_native.CpuNative(lib)
            return Kernels(cpu_layers.NativeAttention(block_size, native), cpu_layers.layer_functions(native),
                           False, draw=native.random_draw, greedy=native.greedy_and_finite)
        from nanoinfer.backends.cpu import rope_write_cpu

        return Kernels(attention_backend(cfg, device, block_size),
                       LayerFunctions(qkv_rope_and_write=rope_write_cpu.qkv_rope_and_write,
                                      rope_tables=rope_write_cpu.rope_tables), False)
    attention = attention_backend(cfg, device, block_size)
    if eager:
        return Kernels(attention, EAGER, False)
    from nanoinfer.backends.cuda.bitmask_triton import masked_float_logits
    from nanoinfer.backends.cuda.draw_triton import triton_draw

    if cfg.num_experts and params is not None:
        from nanoinfer.quant.quantized import ExpertStack

        if any(lp.moe is not None and not isinstance(lp.moe.gate_up, (torch.Tensor, ExpertStack))
               for lp in params.layers):
            raise ValueError(f"{cfg.architecture} cannot run on CUDA with a GGUF's packed experts (the expert "
                             "kernels read float, int8 or fp8 stacks): load it with quantization='none', 'int8' or "
                             "'fp8'")
    return Kernels(attention, cuda_layer_functions(cfg), True, triton_draw, masked_float_logits)


def _invariant_kernels(cfg: ModelConfig, device: torch.device, block_size: int, eager: bool, lacking: str | None,
                       params: Params | None) -> Kernels:
    from nanoinfer.backends.cuda import invariant
    from nanoinfer.backends.cuda.bitmask_triton import masked_float_logits
    from nanoinfer.backends.cuda.draw_triton import triton_draw

    why = lacking and f"deterministic=True cannot run {cfg.architecture} on CUDA yet: {lacking}"
    why = why or invariant.refusal(cfg, params.dtype if params is not None else torch.bfloat16)
    if why:
        raise ValueError(why)
    return Kernels(attention_backend(cfg, device, block_size, deterministic=True), invariant.layer_functions(),
                   not eager, triton_draw, masked_float_logits)


def cuda_layer_functions(cfg: ModelConfig | None = None) -> LayerFunctions:
    """CUDA's layer parts: one token's GEMVs with the norms, SwiGLU and residual adds folded in
    (nanoinfer.backends.cuda.fused_layers), more tokens' Triton row kernels around `linear`
    (nanoinfer.backends.cuda.batched_layers; Gemma's sandwich norms and GeGLU there too), and the fused
    q/k-norm + RoPE + KV-write kernel (at one token without q/k norms, QKV's GEMV epilogue); a mixture of
    experts' sparse layers through nanoinfer.backends.cuda.fused_moe. No torch.compile: a start traces and compiles
    nothing of them (Triton compiles each kernel once per dtype and width, and caches it on disk)."""
    from nanoinfer.backends.cuda import fused_layers
    from nanoinfer.backends.cuda.linear import linear  # (read at each call: bench/latency.py swaps it)

    output_and_mlp = fused_layers.attention_output_and_mlp
    if cfg is not None and cfg.num_experts:
        from nanoinfer.backends.cuda import fused_moe

        output_and_mlp = fused_moe.attention_output_and_mlp
    return EAGER._replace(qkv_rope_and_write=fused_layers.qkv_rope_and_write, linear=linear, lm_head=linear,
                          attention_output_and_mlp=output_and_mlp)


def prepare(kernels: Kernels, params: Params, vocab_size: int) -> None:
    """Before the first step: the sampler's Triton draw compiles now rather than at the first sampled step."""
    if not kernels.graphs:
        return
    probs = torch.full((1, vocab_size), 1.0 / vocab_size, device=params.device)
    zeros = torch.zeros(1, dtype=torch.int64, device=params.device)
    kernels.draw(probs, zeros, zeros)
