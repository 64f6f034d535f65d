"""Quantize a loaded model's matrices (`quantization="int8"`, `"fp8"` or `"int4"`): any checkpoint, at load.

Round to nearest: int8 and fp8 every projection and the LM head, per output channel; int4
every projection per group of 128 inputs (64 or 32 where 128 does not divide a row) with a
scale and a min, as AWQ stores them but without AWQ's activation-aware search, and the LM head
in int8 per output channel (llama.cpp's 4-bit types keep theirs at 6 bits; on the default
model a 4-bit head costs 6.6% more perplexity than a 16-bit one, an 8-bit head 0.3%, and halves
a batch-1 step's largest read: bench/RESULTS.md). int8 and int4 are weight-only;
fp8 (e4m3) also rounds activations per token where a matmul has several rows (see
nanoinfer.quant.quantized.Fp8Weight). The embedding stays as loaded (it is looked up, not
multiplied); a tied LM head gets its own quantized copy. Norms and biases keep the model's
dtype. Matrices a checkpoint already holds in the wanted form (an FP8 checkpoint) stay.
"""

from __future__ import annotations

import dataclasses

import torch

from nanoinfer.model.decoder import Params
from nanoinfer.quant.quantized import (Fp8Weight, GroupedWeight, Int4CudaWeight, Int4Weight, Int8Weight, Weight,
                                       dequantize)

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def int4_groups(w: torch.Tensor) -> GroupedWeight | None:
    """`w` [out, in] as 4-bit groups (the largest of 128, 64, 32 dividing `in`; None if none
    does): per group, scale = (max - min) / 15 and q = round((w - min) / scale), with scale and
    min rounded to fp16 values first where every one of them is an fp16 normal number (the CUDA
    form then stores them in 2 bytes: 4.25 bits a weight instead of 4.5, as gpt-fast's 16-bit
    scales and zeros; the error is still half a step, past the grid's ends an fp16 rounding)."""
    group = next((g for g in (128, 64, 32) if w.shape[1] % g == 0), None)
    if group is None:
        return None
    groups = w.float().unflatten(1, (-1, group))
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = torch.where(high > low, (high - low) / 15, 1.0)
    if all(_fp16_normal(t) for t in (scale, low)):
        scale, low = scale.half().float(), low.half().float()
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).flatten(1)
    return GroupedWeight(q, scale, low, 4)


def _fp16_normal(t: torch.Tensor) -> bool:
    """Whether every value of `t` is 0 or an fp16 normal number's magnitude (no subnormal's lost bits)."""
    magnitude = t.abs()
    return bool(((magnitude == 0) | ((magnitude >= 2**-14) & (magnitude <= 65504))).all())


def quantize_params(params: Params, quantization: str) -> Params:
    if quantization not in ("int8", "fp8", "int4"):
        raise ValueError(f"cannot quantize to {quantization!r} (expected 'int8', 'fp8' or 'int4')")
    # The CPU kernel (torch._weight_int8pack_mm) takes bf16 scales; elsewhere they stay fp32.
    scale_dtype = torch.bfloat16 if params.device.type == "cpu" else torch.float32
    form = Fp8Weight if quantization == "fp8" else Int8Weight

    def convert(w: Weight):
        if isinstance(w, form):
            return w
        dense = w if isinstance(w, torch.Tensor) else dequantize(w)
        return Int8Weight.quantize(dense, scale_dtype) if form is Int8Weight else Fp8Weight.quantize(dense)

    if quantization == "int4":
        return _map_matrices(params, lambda w: _int4(w, params), head=convert)
    return _map_matrices(params, convert, head=convert)


def _int4(w: Weight, params: Params) -> Weight:
    from nanoinfer.loaders.params import device_form

    if isinstance(w, (Int4CudaWeight, Int4Weight)):
        return w
    grouped = int4_groups(w if isinstance(w, torch.Tensor) else dequantize(w))
    return w if grouped is None else device_form(grouped, params.device, params.dtype)


def _map_matrices(params: Params, convert, head) -> Params:
    """`convert` applied to every layer's projections, `head` to the LM head (if this stage has one)."""
    layers = tuple(dataclasses.replace(lp, **{name: convert(getattr(lp, name)) for name in PROJECTIONS})
                   for lp in params.layers)
    lm_head = params.lm_head if params.lm_head is None else head(params.lm_head)
    return dataclasses.replace(params, layers=layers, lm_head=lm_head)
