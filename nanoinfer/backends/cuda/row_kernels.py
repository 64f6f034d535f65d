"""Triton kernels for the element-wise steps between a many-token step's projections: RMSNorm,
residual add + RMSNorm, SiLU(gate) · up (Gemma's GELU-tanh(gate) · up), and an fp8 projection's per-row activation
scaling.

These were torch.compile'd layer parts, whose Dynamo tracing and Inductor compiling cost most of
a cold start (bench/RESULTS.md, issue 35 item 3); three small kernels of our own compile in a
second and fuse the same: each reads its inputs once and writes its outputs once. Each rounds
as the torch ops it replaces (nanoinfer.model.layers' `rms_norm` and `swiglu`, the residual add) so
that the eager functions stay the reference up to the order of the fp32 sums: the statistics in
fp32, the normed activations rounded to the model's dtype before the gain multiplies them.

The norms take one program per token row, the whole row in one block (hidden sizes up to
`MAX_HIDDEN`); SiLU · up takes a program per (row, block of columns), so a decode batch of a
few rows still spreads its wide intermediate rows over the GPU. The token count is a launch
dimension only, never a compile-time constant: one compile serves every batch, there are no
host syncs, and CUDA graphs capture the launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.quant import quantized

MAX_HIDDEN = 8192  # the widest row a norm holds in one block (Llama-3 70B's hidden size)
SILU_BLOCK = 1024  # the columns of a SiLU · up program, and of one step over a row to quantize


@triton.jit
def _norm_row(s, w_ptr, offs, mask, n, eps, x_ptr, ROUND: tl.constexpr):
    # `s`: the row in fp32 (zeros past n). rms_norm's order: x * rsqrt(mean(x²) + eps) in fp32,
    # rounded to x's dtype (ROUND: not for fp32), then times the gain in fp32 (the caller rounds).
    normed = s * tl.rsqrt(tl.sum(s * s, 0) / n + eps)
    if ROUND:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * normed


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_out, eps, ROUND: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _norm_row(s, w_ptr, offs, mask, n, eps, x_ptr, ROUND)
    tl.store(out_ptr + row * stride_out + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, n, stride_x, stride_y, stride_out, eps,
                         ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    # (the new residual stream rounded first, as `x + y` in the model's dtype stores it; the norm reads that)
    s = (x + y).to(dtype)
    tl.store(sum_ptr + row * stride_out + offs, s, mask=mask)
    normed = _norm_row(s.to(tl.float32), w_ptr, offs, mask, n, eps, sum_ptr, ROUND)
    tl.store(out_ptr + row * stride_out + offs, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # GELU-tanh: 0.5 g (1 + tanh(u)) = g sigmoid(2 u), u = sqrt(2 / pi) (g + 0.044715 g³)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # F.silu (F.gelu) rounds to the model's dtype, then the product rounds again
    tl.store(out_ptr + row * stride_out + offs, (act.to(dtype).to(tl.float32) * up).to(dtype), mask=mask)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, n, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    # Two passes over the row (an intermediate row is wider than a block holds): its largest
    # magnitude, then the row divided by its scale, saturated and rounded to e4m3. An IEEE
    # division (div_rn), as torch's: the same e4m3 values as quantized.quantize_rows_fp8.
    row = tl.program_id(0).to(tl.int64)
    top = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < n, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    scale = tl.maximum(tl.max(top, 0) * (1.0 / FP8_MAX), 1e-12)  # (times 1/448 in fp32, as the reference)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, what: str) -> int:
    """The row width of a 2-D activation `x` whose rows are contiguous; a clear error otherwise."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{what}: expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.shape[1]


def _block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a norm over rows of `n`."""
    if n > MAX_HIDDEN:
        raise ValueError(f"a row-wise RMSNorm holds at most {MAX_HIDDEN} values in one block, got a row of {n}")
    block = triton.next_power_of_2(n)
    return block, max(1, min(16, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """nanoinfer.model.layers.rms_norm of [tokens, hidden] `x` (fp32 statistics; the result in the
    dtype `weight * x` has, as there)."""
    n = _rows(x, "rms_norm")
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    if x.shape[0]:
        block, warps = _block(n)
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, n, x.stride(0), out.stride(0), eps,
                                        ROUND=x.dtype != torch.float32, BLOCK=block, num_warps=warps)
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """(x + y, rms_norm(x + y, weight, eps)) in one pass: the new residual stream and its norm."""
    n = _rows(x, "add_rms_norm")
    if y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: expected y like x {tuple(x.shape)} {x.dtype}, got {tuple(y.shape)} {y.dtype}")
    _rows(y, "add_rms_norm")
    total = x.new_empty(x.shape)
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    if x.shape[0]:
        block, warps = _block(n)
        _add_rms_norm_kernel[(x.shape[0],)](x, y, weight, total, out, n, x.stride(0), y.stride(0), out.stride(0),
                                            eps, ROUND=x.dtype != torch.float32, BLOCK=block, num_warps=warps)
    return total, out


def silu_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """nanoinfer.model.layers.swiglu: silu(gate) * up of [tokens, 2 * intermediate] (gate then up); with act
    "gelu_tanh", nanoinfer.model.layers.gelu_tanh_mul (Gemma's GeGLU)."""
    n = _rows(gate_up, "silu_mul") // 2
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"silu_mul: act={act!r}, expected 'silu' or 'gelu_tanh'")
    out = gate_up.new_empty((gate_up.shape[0], n))
    if gate_up.shape[0]:
        _gated_mul_kernel[(gate_up.shape[0], triton.cdiv(n, SILU_BLOCK))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), GELU=act == "gelu_tanh", BLOCK=SILU_BLOCK)
    return out


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoinfer.quant.quantized.quantize_rows_fp8 in one kernel: [tokens, in] -> (e4m3 [tokens, in],
    fp32 scale [tokens, 1]), each row's largest magnitude at e4m3's largest value. (An fp8
    weight's projection of several rows quantizes its activations so: eager, that was about
    eight kernels a projection.)"""
    n = _rows(x, "quantize_rows_fp8")
    q = x.new_empty(x.shape, dtype=quantized.FP8)
    scale = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    if x.shape[0]:
        _fp8_rows_kernel[(x.shape[0],)](x, q, scale, n, x.stride(0), q.stride(0), FP8_MAX=quantized.FP8_MAX,
                                        BLOCK=SILU_BLOCK)
    return q, scale
