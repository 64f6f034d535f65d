"""Quantize a loaded model's matrices (`quantization="int8"` or `"fp8"`): any checkpoint, at load.

Per output channel, round to nearest: every projection and the LM head. int8 is weight-only;
fp8 (e4m3) also rounds activations per token where a matmul has several rows (see
nanoinfer.quantized.Fp8Weight). The embedding stays as loaded (it is looked up, not
multiplied); a tied LM head gets its own quantized copy. Norms and biases keep the model's
dtype. Matrices a checkpoint already holds in the wanted form (an FP8 checkpoint) stay.
"""

from __future__ import annotations

import dataclasses

import torch

from nanoinfer.model import Params
from nanoinfer.quantized import Fp8Weight, Int8Weight, Weight, dequantize

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_params(params: Params, quantization: str) -> Params:
    if quantization not in ("int8", "fp8"):
        raise ValueError(f"cannot quantize to {quantization!r} (expected 'int8' or 'fp8')")
    # The CPU kernel (torch._weight_int8pack_mm) takes bf16 scales; elsewhere they stay fp32.
    scale_dtype = torch.bfloat16 if params.device.type == "cpu" else torch.float32
    form = Int8Weight if quantization == "int8" else Fp8Weight

    def convert(w: Weight):
        if isinstance(w, form):
            return w
        dense = w if isinstance(w, torch.Tensor) else dequantize(w)
        return Int8Weight.quantize(dense, scale_dtype) if form is Int8Weight else Fp8Weight.quantize(dense)

    layers = tuple(dataclasses.replace(lp, **{name: convert(getattr(lp, name)) for name in PROJECTIONS})
                   for lp in params.layers)
    return dataclasses.replace(params, layers=layers, lm_head=convert(params.lm_head))
