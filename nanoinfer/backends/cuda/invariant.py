"""The deterministic mode's layer parts on CUDA: a row's bits do not depend on the rows beside it.

`deterministic=True` (`--deterministic`) runs these in place of the default parts, so that a
request's tokens and logprobs are the same whether it runs alone or batched with any others,
chunked at any size, preempted and recomputed, prefix-cached or not, in a CUDA graph or eagerly.
The default parts pick their arithmetic by the step's row count: a one-row CUDA-core GEMV with
the norm folded in at one token, tensor cores up to 16 rows, cuBLAS past them (whose tiling,
split-K included, follows the shape). Here every projection at every row count is one
tensor-core kernel, `tiled_matmul` (4-bit weights: `int4_mm`'s tensor-core kernel, one row
included), whose sums over K run in the same order for every tile shape; the norms, SiLU · up
and the residual adds are nanoinfer.backends.cuda.row_kernels' one-program-per-row kernels at
every row count (nanoinfer.backends.cuda.batched_layers, as more than one token runs by default),
SiLU · up and the MLP's residual add folded into the products' epilogues with those kernels' bits;
RoPE and the KV write nanoinfer.backends.cuda.rope_write's kernel, one program per token and head.
The attention's half is TritonPagedAttention's `deterministic` (no split over the keys, one key
tile for every step); the sampler's argmax, draw and log-softmax are one program (or one torch
reduction) per row already.

What it costs: at one token the fused GEMVs' savings (the norm, SwiGLU and residual in their
epilogues) and the CUDA-core GEMV's edge over tensor cores for one row; at batch 1 over long
contexts the attention's split (bench/RESULTS.md, issue 65). tests/test_gpu_determinism.py holds
each invariance.
"""

from __future__ import annotations

import torch

from nanoinfer.backends.cuda import batched_layers
from nanoinfer.backends.cuda.gemv import tiled_matmul
from nanoinfer.backends.cuda.int4_gemv import int4_kernels_take, int4_mm
from nanoinfer.backends.cuda.rope_write import rope_and_write
from nanoinfer.backends.cuda.row_kernels import add_rms_norm, rms_norm
from nanoinfer.model import decoder as model
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import EAGER, LayerFunctions, LayerParams
from nanoinfer.quant import quantized
from nanoinfer.quant.quantized import Fp8Weight, Int4CudaWeight, Int8Weight


def linear(x: torch.Tensor, w: quantized.Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) with one reduction order per row whatever x's row count: `tiled_matmul` for a
    bf16/fp16, int8 or fp8 weight (the last two widened exactly in registers, their scale in fp32
    before the one rounding), `int4_mm`'s tensor-core kernel for a 4-bit one; any other form
    dequantized first (a 4-bit weight of groups the kernels do not take)."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), w, b).reshape(*x.shape[:-1], -1)
    if isinstance(w, (Int8Weight, Fp8Weight)):
        out = tiled_matmul(x, w.q, w.scale)
    elif isinstance(w, Int4CudaWeight) and int4_kernels_take(w):
        out = int4_mm(x if w.cols is None else x.index_select(1, w.cols), w.packed, w.scale, w.min, invariant=True)
    elif isinstance(w, torch.Tensor):
        out = tiled_matmul(x, w if w.stride(1) == 1 else w.contiguous())
    else:
        out = tiled_matmul(x, quantized.dequantize(w).to(x.dtype))
    return out if b is None else out + b


def _product(x: torch.Tensor, w: quantized.Weight, **epilogue) -> torch.Tensor:
    """`tiled_matmul` of a weight it reads (dense, int8, fp8) with its epilogue."""
    if isinstance(w, (Int8Weight, Fp8Weight)):
        return tiled_matmul(x, w.q, w.scale, **epilogue)
    return tiled_matmul(x, w if w.stride(1) == 1 else w.contiguous(), **epilogue)


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear,
                             reduce=model._same) -> torch.Tensor:
    """batched_layers' with SiLU · up in the gate/up product's epilogue and the residual add in the down
    projection's: the same bits, two kernels fewer a layer (where tiled_matmul reads the weights and no
    tensor-parallel sum runs between a projection and its add)."""
    products = (lp.o_proj, lp.gate_up_proj, lp.down_proj)
    if (reduce is not model._same or cfg.sandwich_norms or cfg.hidden_act != "silu"
            or not all(isinstance(w, (torch.Tensor, Int8Weight, Fp8Weight)) for w in products)):
        return batched_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, reduce)
    x, h = add_rms_norm(x, _product(attn.reshape(x.shape[0], cfg.q_size), lp.o_proj), lp.mlp_norm, cfg.rms_norm_eps)
    return _product(_product(h, lp.gate_up_proj, silu=True), lp.down_proj, residual=x)


def qkv_rope_and_write(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear, cos: torch.Tensor,
                       sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q, with k and v into the pool: the batched parts at every row count (no GEMV epilogue)."""
    return rope_and_write(batched_layers.qkv_projection(x, lp, cfg, linear), lp.q_norm, lp.k_norm, cos, sin,
                          kv_layer, slot_mapping, cfg)


def layer_functions() -> LayerFunctions:
    return EAGER._replace(qkv_rope_and_write=qkv_rope_and_write, linear=linear, lm_head=linear,
                          attention_output_and_mlp=attention_output_and_mlp, norm=rms_norm)


def refusal(cfg: ModelConfig, dtype: torch.dtype) -> str | None:
    """Why the deterministic mode cannot run `cfg` in `dtype` on CUDA, as one line; None: it can."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"deterministic=True runs bf16 or fp16 models on CUDA, not {dtype} (load it with dtype='bfloat16')"
    if cfg.architecture == "nanochat":
        return "deterministic=True does not run nanochat models on CUDA yet (their forward has no batch-invariant parts)"
    return None
