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
dtype. Matrices a checkpoint already holds in the wanted form (an FP8 checkpoint) stay. A
mixture-of-experts layer's experts become an `ExpertStack` in int8 or fp8 (its router stays as
loaded: it picks the experts); int4 experts are refused before any weight is read
(nanoinfer.loaders' `_refuse_quantized_experts`). `quantize_layer` is one layer's part: the
loaders quantize each layer as they read it (or, for `load_format="dummy"`, make it), then the
head (`quantize_head`), so a model whose float weights do not fit the device (Mixtral-8x7B's
93 GB of bf16 on an 80 GB H100) loads in fp8; `quantize_params` does all of it to loaded params.
"""

from __future__ import annotations

import dataclasses

import torch

from nanoinfer.model.decoder import LayerParams, Params
from nanoinfer.quant.quantized import (ExpertStack, Fp8Weight, GroupedWeight, Int4CudaWeight, Int4Weight, Int8Weight,
                                       Weight, dequantize)

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


def _check(quantization: str) -> None:
    if quantization not in ("int8", "fp8", "int4"):
        raise ValueError(f"cannot quantize to {quantization!r} (expected 'int8', 'fp8' or 'int4')")


def quantize_params(params: Params, quantization: str) -> Params:
    """Every layer's matrices (`quantize_layer`) and the LM head (`quantize_head`) in `quantization`."""
    _check(quantization)
    layers = tuple(quantize_layer(lp, quantization, params.device, params.dtype) for lp in params.layers)
    return quantize_head(dataclasses.replace(params, layers=layers), quantization)


def quantize_head(params: Params, quantization: str) -> Params:
    """The LM head (if this stage has one) in `quantization`, int4's in int8; a tied head gets its own copy."""
    _check(quantization)
    head = params.lm_head if params.lm_head is None else _per_row(
        params.lm_head, "fp8" if quantization == "fp8" else "int8", params.device)
    return dataclasses.replace(params, lm_head=head)


def quantize_layer(lp: LayerParams, quantization: str, device: torch.device, dtype: torch.dtype) -> LayerParams:
    """One layer's projections (and experts) in `quantization`; a matrix already in that form stays."""
    _check(quantization)
    convert = (lambda w: _int4(w, device, dtype)) if quantization == "int4" else (
        lambda w: _per_row(w, quantization, device))
    layer = dataclasses.replace(lp, **{name: convert(getattr(lp, name)) for name in PROJECTIONS
                                       if getattr(lp, name) is not None})  # (a sparse layer has no dense MLP)
    if lp.moe is None or quantization == "int4":
        return layer
    form = Fp8Weight if quantization == "fp8" else Int8Weight

    def stack(w):
        return w if isinstance(w, ExpertStack) else ExpertStack.quantize(w, form, _scale_dtype(device))

    return dataclasses.replace(layer, moe=dataclasses.replace(lp.moe, gate_up=stack(lp.moe.gate_up),
                                                              down=stack(lp.moe.down)))


def _scale_dtype(device: torch.device) -> torch.dtype:
    # The CPU kernel (torch._weight_int8pack_mm) takes bf16 scales; elsewhere they stay fp32.
    return torch.bfloat16 if torch.device(device).type == "cpu" else torch.float32


def _per_row(w: Weight, quantization: str, device: torch.device) -> Weight:
    form = Fp8Weight if quantization == "fp8" else Int8Weight
    if isinstance(w, form):
        return w
    dense = w if isinstance(w, torch.Tensor) else dequantize(w)
    return Int8Weight.quantize(dense, _scale_dtype(device)) if form is Int8Weight else Fp8Weight.quantize(dense)


def _int4(w: Weight, device: torch.device, dtype: torch.dtype) -> Weight:
    from nanoinfer.loaders.params import device_form

    if isinstance(w, (Int4CudaWeight, Int4Weight)):
        return w
    grouped = int4_groups(w if isinstance(w, torch.Tensor) else dequantize(w))
    return w if grouped is None else device_form(grouped, device, dtype)
