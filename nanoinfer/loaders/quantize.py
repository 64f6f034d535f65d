"""Quantize a loaded model's matrices (`quantization="int8"`): any checkpoint, at load.

Weight-only, per output channel, round to nearest: every projection and the LM head. The
embedding stays as loaded (it is looked up, not multiplied); a tied LM head gets its own
quantized copy. Norms and biases keep the model's dtype.
"""

from __future__ import annotations

import dataclasses

import torch

from nanoinfer.model import Params
from nanoinfer.quantized import Int8Weight, Weight, dequantize

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_params(params: Params, quantization: str) -> Params:
    if quantization != "int8":
        raise ValueError(f"cannot quantize to {quantization!r} (expected 'int8')")
    # The CPU kernel (torch._weight_int8pack_mm) takes bf16 scales; elsewhere they stay fp32.
    scale_dtype = torch.bfloat16 if params.device.type == "cpu" else torch.float32

    def int8(w: Weight) -> Int8Weight:
        if isinstance(w, Int8Weight):
            return w
        return Int8Weight.quantize(w if isinstance(w, torch.Tensor) else dequantize(w), scale_dtype)

    layers = tuple(dataclasses.replace(lp, **{name: int8(getattr(lp, name)) for name in PROJECTIONS})
                   for lp in params.layers)
    return dataclasses.replace(params, layers=layers, lm_head=int8(params.lm_head))
