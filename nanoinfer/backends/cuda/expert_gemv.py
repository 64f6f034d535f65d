"""The experts of a few tokens on CUDA (a decode step): two GEMV kernels that read each chosen expert's rows once.

At batch 1 a mixture-of-experts layer reads k experts' matrices for one token's activations: a matrix-vector
product, memory bound. The grouped kernel (nanoinfer.backends.cuda.fused_moe) pads each pair to a 16-row tensor-core
tile and needs the pairs sorted by expert first (`align`: about ten small launches a layer); here, as the dense
one-row GEMV (nanoinfer.backends.cuda.gemv) does, each program owns BLOCK_N output rows of one pair's expert and
sums their whole K extent on CUDA cores in wide loads, and the routing's own [tokens, k] choices index the experts
directly:

- `_gate_up_kernel`, one program per (pair, BLOCK_N units): the unit's gate and up rows, then SiLU(gate) * up,
  rounded as the eager parts round (the product, the activation, their product);
- `_down_kernel`, one program per (token, BLOCK_N rows): the token's k experts' rows one after another, each
  product weighted in fp32 and rounded, the k added in fp32 in choice order and rounded once (as the grouped
  kernel's `sum_pairs`; nanoinfer.model.moe.experts_reference rounds each product before its weight and adds in
  the model's dtype in expert order: within a rounding of it), then the residual added where the caller passes it.

Experts stacked in int8 or fp8 (nanoinfer.quant.quantized.ExpertStack, `quantization="int8"`/`"fp8"`) are read at
one byte a weight, widened in registers, each row's sum times its scale: a decode reads half a bf16 stack's bytes.

A token's bits do not depend on the other tokens of the step (no atomics, no split over K); they differ from the
grouped kernel's, whose tensor-core tiles sum K in another order (the dense GEMV and GEMM differ alike).
tests/test_fused_moe.py holds both against the reference and against each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.quant.quantized import ExpertStack

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel: bench/moe_kernels.py times the candidates. On an H100
# (bench/RESULTS.md, thirteenth session) gate/up's 16 x 256 was the best or within 4% at 1-8 tokens of both MoE
# shapes; the down kernel's k experts a program read best in 2 rows x 1024 columns at 1-2 tokens (Qwen3-30B-A3B
# 11.6 against 15.0 us at one token, Mixtral 78.8 against 109.3), within 8% of the best beyond.
GATE_UP_TILES = (16, 256, 4, 3)
DOWN_TILES = (2, 1024, 4, 4)


def stack_and_scale(w: torch.Tensor | ExpertStack) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stacked matrices a kernel reads ([experts, rows, cols]) and their scales per row ([experts, rows] fp32;
    None for a float stack)."""
    if isinstance(w, ExpertStack):
        return w.q, w.scale.float()
    return w, None


@triton.jit
def widen(w, INT8: tl.constexpr):
    """A weight tile in fp32: int8 without I2F (nanoinfer.backends.cuda.gemv's trick: q + 128 added to the bits of
    2^23 is the float 2^23 + q + 128, exactly), any float type converted."""
    if INT8:
        return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, experts_ptr, out_ptr, INTER, K, TOP_K, stride_xm, stride_we, stride_wn,
                    stride_se, stride_om, GELU: tl.constexpr, HAS_SCALE: tl.constexpr, INT8: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    gate_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER.to(tl.int64) * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = n_mask[:, None] & k_mask[None, :]
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc_gate += widen(tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0), INT8) * x
        acc_up += widen(tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0), INT8) * x
    dtype = out_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, 1)
    up = tl.sum(acc_up, 1)
    if HAS_SCALE:
        scales = scale_ptr + expert * stride_se + offs_n
        gate *= tl.load(scales, mask=n_mask, other=0.0)
        up *= tl.load(scales + INTER, mask=n_mask, other=0.0)
    gate = gate.to(dtype).to(tl.float32)  # (the projection's output, rounded as a matmul's)
    up = up.to(dtype).to(tl.float32)
    if GELU:  # GELU-tanh: g sigmoid(2 u), u = sqrt(2 / pi) (g + 0.044715 g³)
        act = gate / (1.0 + tl.exp(-2.0 * (0.7978845608028654 * (gate + 0.044715 * gate * gate * gate))))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, (act.to(dtype).to(tl.float32) * up).to(dtype),
             mask=n_mask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, scale_ptr, experts_ptr, weight_ptr, res_ptr, out_ptr, N, K, TOP_K, stride_hm, stride_we,
                 stride_wn, stride_se, stride_om, RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr, INT8: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(experts_ptr + pair).to(tl.int64)
        rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            h = tl.load(h_ptr + pair * stride_hm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += widen(w, INT8) * h[None, :]
        y = tl.sum(acc, 1)
        if HAS_SCALE:
            y *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0)
        # (the routing weight in fp32, the weighted product rounded before its add: the grouped kernel's order)
        total += (y * tl.load(weight_ptr + pair)).to(dtype).to(tl.float32)
    out = total.to(dtype)
    if RESIDUAL:  # (x + experts(x), rounded as the eager add rounds)
        out = (tl.load(res_ptr + token * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
               + out.to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * stride_om + offs_n, out, mask=n_mask)


def gate_up(x: torch.Tensor, w: torch.Tensor | ExpertStack, experts: torch.Tensor, act: str = "silu",
            tiles: tuple[int, int, int, int] = GATE_UP_TILES) -> torch.Tensor:
    """[tokens k, inter]: act(gate) * up of each (token, choice) pair's expert, for x [tokens, hidden], w [experts,
    2 inter, hidden] (gate rows then up rows), experts [tokens, k] (the pairs in token-major order)."""
    tokens, top_k = experts.shape
    w, scale = stack_and_scale(w)
    _, two_inter, k = w.shape
    out = x.new_empty((tokens * top_k, two_inter // 2))
    block_n, block_k, warps, stages = tiles
    if tokens:
        _gate_up_kernel[(tokens * top_k, triton.cdiv(two_inter // 2, block_n))](
            x, w, w if scale is None else scale, experts.contiguous(), out, two_inter // 2, k, top_k, x.stride(0),
            w.stride(0), w.stride(1), 0 if scale is None else scale.stride(0), out.stride(0), GELU=act == "gelu_tanh",
            HAS_SCALE=scale is not None, INT8=w.dtype == torch.int8, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages)
    return out


def down(h: torch.Tensor, w: torch.Tensor | ExpertStack, experts: torch.Tensor, weights: torch.Tensor,
         residual: torch.Tensor | None = None, tiles: tuple[int, int, int, int] = DOWN_TILES) -> torch.Tensor:
    """[tokens, hidden]: each token's k pairs' rows of h [tokens k, inter] through their experts' w [experts,
    hidden, inter], weighted by weights [tokens, k] (fp32) and summed (plus `residual` [tokens, hidden])."""
    tokens, top_k = experts.shape
    w, scale = stack_and_scale(w)
    _, n, k = w.shape
    out = h.new_empty((tokens, n))
    block_n, block_k, warps, stages = tiles
    if residual is not None:
        assert residual.shape == out.shape and residual.is_contiguous() and residual.dtype == h.dtype
    if tokens:
        _down_kernel[(tokens, triton.cdiv(n, block_n))](
            h, w, w if scale is None else scale, experts.contiguous(), weights.to(torch.float32).contiguous(),
            out if residual is None else residual, out, n, k, top_k, h.stride(0), w.stride(0), w.stride(1),
            0 if scale is None else scale.stride(0), out.stride(0), RESIDUAL=residual is not None,
            HAS_SCALE=scale is not None, INT8=w.dtype == torch.int8, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages)
    return out
