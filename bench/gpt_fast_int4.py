"""gpt-fast's int4 weight-only method (`quantize.py --mode int4`) inside our engine, as the baseline for ours.

gpt-fast rounds each projection and the LM head to 4 bits per group of inputs (a scale and a
zero, round to nearest: the numbers `quantization="int4"` gives the projections), packs them
with torch's `_convert_weight_to_int4pack` and multiplies with `_weight_int4pack_mm` (the "tinygemm"
kernel) at every row count. Here the same weights go through that kernel instead of
nanoinfer.backends.cuda.int4_gemv's `int4_mm`, so the two kernels meet in one engine (bench/latency.py's
`gpt-fast-int4`). A bench module: the library has no use for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nanoinfer.quant import quantized
from nanoinfer.loaders.quantize import PROJECTIONS, int4_groups
from nanoinfer.model.decoder import Params

INNER_K_TILES = 8  # gpt-fast's default


@dataclass(frozen=True)
class TinygemmInt4:
    packed: torch.Tensor  # _convert_weight_to_int4pack's layout
    scales_and_zeros: torch.Tensor  # [in // group, out, 2] bf16: w = (q - 8) * scale + zero
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales_and_zeros.shape[1], self.scales_and_zeros.shape[0] * self.group


def tinygemm_weight(w: torch.Tensor) -> TinygemmInt4 | torch.Tensor:
    """A dense CUDA matrix [out, in] as gpt-fast packs it (kept dense where the kernel's tiling
    does not divide it)."""
    grouped = int4_groups(w)
    if grouped is None or w.shape[1] % (INNER_K_TILES * 16) or w.shape[0] % 8:
        return w
    q = grouped.q.to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), INNER_K_TILES)
    zeros = grouped.min + 8 * grouped.scale  # (q - 8) * s + z = s q + min
    sz = torch.stack((grouped.scale, zeros), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return TinygemmInt4(packed, sz, grouped.group)


def tinygemm_params(params: Params) -> Params:
    """Every matrix of dense CUDA `params` in gpt-fast's int4 form, the LM head included (its
    `quantize.py` converts every nn.Linear, the output layer too; `quantization="int4"` keeps
    the head at 8 bits instead, so the two sides' heads differ as the two methods do)."""
    def convert(w):
        return tinygemm_weight(w if isinstance(w, torch.Tensor) else quantized.dequantize(w).to(params.dtype))

    layers = tuple(dataclasses.replace(lp, **{n: convert(getattr(lp, n)) for n in PROJECTIONS}) for lp in params.layers)
    return dataclasses.replace(params, layers=layers, lm_head=convert(params.lm_head))


def with_tinygemm(linear):
    """`linear` (nanoinfer.backends.cuda.linear.linear) with TinygemmInt4 weights sent to `_weight_int4pack_mm`."""
    def tinygemm_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(w, TinygemmInt4):
            return linear(x, w, b)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm(rows, w.packed, w.group, w.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        return out if b is None else out + b

    return tinygemm_linear
