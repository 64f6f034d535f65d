"""The mixture-of-experts MLP's experts on CUDA: the (token, choice) pairs sorted by expert, one grouped launch per projection.

nanoinfer.model.moe's `experts_reference` loops over the experts a step chose, one pair of matmuls each, and
reads their count back to the host: no CUDA graph can capture it. Here (vLLM's fused_moe and mini-sglang's,
in their plainest form) `align` lays the step's pairs out expert by expert, each expert's run padded to whole
blocks of BLOCK_M, with torch ops of fixed shapes (no host sync); `_experts_kernel` then runs one program per
(block, column tile): it reads its block's expert, gathers the block's rows (a token's activations for the
gate/up projection, a pair's for the down projection), and multiplies them by that expert's matrix. A step
reads only the chosen experts' weights: at batch 1, k experts' (the other blocks are padding and return at
once). The down projection's products are weighted by the routing weights in fp32, rounded, and a token's k
products add in fp32 in choice order (no atomics: the same bits whatever the batch's other tokens; the reference
adds them in the model's dtype in expert order, within a rounding of this).
Stacked bf16/fp16 weights ([experts, rows, cols]), or int8/e4m3 ones with a scale per row (ExpertStack: each tile
widened to the activations' dtype, exactly, each row's sums times its scale); tests/test_fused_moe.py holds it
against the reference. A decode's few pairs go to nanoinfer.backends.cuda.expert_gemv instead (`few_pairs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda import expert_gemv, fused_layers
from nanoinfer.backends.cuda.expert_gemv import stack_and_scale
from nanoinfer.backends.cuda.row_kernels import add_rms_norm, silu_mul
from nanoinfer.model import decoder as model
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import LayerParams
from nanoinfer.quant.quantized import ExpertStack

BLOCK_M = 16  # pairs a program takes (tl.dot's smallest tile): the padding an expert's run costs at most
BLOCK_K = 64  # the columns of one step of a product's sum


def align(experts: torch.Tensor, num_experts: int, block: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's pairs (token t's choice j is pair t k + j) expert by expert: (slots [S] int32, the pair each slot
    holds, the pair count where a slot pads its expert's run to whole blocks; block_expert [S / block] int32, each
    block's expert, `num_experts` past the last used block). S = pairs + min(num_experts, pairs) (block - 1),
    rounded up to a block: the most any routing needs (at most that many experts each pad one run), so every
    shape is fixed by the batch's size alone (CUDA graphs), and a decode's grid holds its k blocks, not one a
    possible expert."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    slots_max = triton.cdiv(pairs + min(num_experts, pairs) * (block - 1), block) * block
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # (an expert's pairs in token order)
    chosen = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[chosen]
    slots = torch.full((slots_max,), pairs, dtype=torch.int32, device=flat.device)
    slots[(ends - padded)[chosen] + rank] = order.to(torch.int32)
    starts = torch.arange(0, slots_max, block, device=flat.device)
    return slots, torch.searchsorted(ends, starts, right=True).to(torch.int32)


@triton.jit
def _experts_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, slots_ptr, block_expert_ptr, weight_ptr, PAIRS, N, K, TOP_K,
                    NUM_EXPERTS, stride_xm, stride_we, stride_wn, stride_se, stride_om, HAS_SCALE: tl.constexpr,
                    TOKENS: tl.constexpr,
                    WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    # out[pair] = x[row] @ w[expert].T for the block's pairs, row = the pair's token (TOKENS) or the pair itself
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:  # (padding past the step's last block)
        return
    pair = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < PAIRS
    row = pair // TOP_K if TOKENS else pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + row[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)  # (int8, e4m3: exact in bf16)
    if HAS_SCALE:  # (an int8 or fp8 stack: each row's scale)
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
    if WEIGHTED:  # (the routing weight, fp32, before the one rounding)
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


def _grouped(x: torch.Tensor, w: torch.Tensor | ExpertStack, slots: torch.Tensor, block_expert: torch.Tensor,
             pairs: int, top_k: int, tokens: bool, weights: torch.Tensor | None = None) -> torch.Tensor:
    """out [pairs, w rows] of `_experts_kernel`."""
    w, scale = stack_and_scale(w)
    experts, n, k = w.shape
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    block_n, warps, stages = tiles(pairs)
    _experts_kernel[(block_expert.numel(), triton.cdiv(n, block_n))](
        x, w, w if scale is None else scale, out, slots, block_expert, out if weights is None else weights, pairs, n,
        k, top_k, experts, x.stride(0), w.stride(0), w.stride(1), 0 if scale is None else scale.stride(0),
        out.stride(0), HAS_SCALE=scale is not None, TOKENS=tokens, WEIGHTED=weights is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=warps, num_stages=stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32")  # (fp32 weights: no TF32 rounding)
    return out


def tiles(pairs: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a call with `pairs` pairs: few pairs, narrower column tiles, more
    programs (bench/moe_kernels.py times the choices). K's steps stay BLOCK_K at any batch: a row's sums the same."""
    return (64 if pairs > 64 else 32), 4, 3


@triton.jit
def _sum_pairs_kernel(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # out[token] = the token's k weighted products summed in fp32 in choice order, rounded once
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_pairs(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """[tokens, hidden]: each token's k rows of y [tokens * k, hidden] added in fp32 in order, in one kernel (the
    torch form, y.view(tokens, k, -1).float().sum(1).to(dtype), is three)."""
    tokens, n = y.shape[0] // top_k, y.shape[1]
    out = y.new_empty((tokens, n))
    if tokens:
        _sum_pairs_kernel[(tokens, triton.cdiv(n, 1024))](y, out, n, TOP_K=top_k, BLOCK=1024)
    return out


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, E, stride_l, TOP_K: tl.constexpr, PICKS: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK: tl.constexpr):
    # moe.route of one token's logits: softmax in fp32, then k times the largest probability left (ties to the
    # lower index, as torch.topk), taken out; the k divided by their sum where RENORMALIZE
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    logits = tl.load(logits_ptr + token * stride_l + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, 0))
    probs = e / tl.sum(e, 0)
    picks = tl.arange(0, PICKS)  # (TOP_K rounded up to a power of two)
    chosen = tl.zeros([PICKS], tl.int32)
    weight = tl.zeros([PICKS], tl.float32)
    for j in tl.static_range(TOP_K):
        best, at = tl.max(probs, 0, return_indices=True, return_indices_tie_break_left=True)
        chosen = tl.where(picks == j, at, chosen)
        weight = tl.where(picks == j, best, weight)
        probs = tl.where(offs == at, -1.0, probs)
    if RENORMALIZE:
        weight = weight / tl.sum(weight, 0)
    tl.store(weights_ptr + token * TOP_K + picks, weight, mask=picks < TOP_K)
    tl.store(experts_ptr + token * TOP_K + picks, chosen.to(tl.int64), mask=picks < TOP_K)


def route(router_logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoinfer.model.moe.route in one kernel (torch's is four or five launches a layer): (weights [tokens, k]
    fp32, experts [tokens, k] int64)."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, k, dtype=torch.float32, device=router_logits.device)
    chosen = torch.empty(tokens, k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, chosen, experts, router_logits.stride(0), TOP_K=k,
                                 PICKS=triton.next_power_of_2(k), RENORMALIZE=renormalize,
                                 BLOCK=triton.next_power_of_2(experts))
    return weights, chosen


def few_pairs(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a step's experts go to nanoinfer.backends.cuda.expert_gemv: while its pairs are few enough that
    an expert seldom serves two of them (each pair reads its expert's rows for itself there). On an H100 the
    GEMVs took 43-178 us against the grouped kernel's 89-230 at 1-8 tokens of Qwen3-30B-A3B (128 experts, k 8:
    up to 64 pairs), and won Mixtral's (8 experts, k 2) 1-2 tokens, tied at 4, lost at 8 (bench/moe_kernels.py)."""
    return tokens * top_k <= max(top_k, num_experts // 2)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """moe.experts_reference's sum over a token's chosen experts for x [tokens, hidden] (gate_up [experts, 2 inter,
    hidden], down [experts, hidden, inter], weights and experts [tokens, k] from moe.route), in x's dtype, plus
    `residual` where given: a decode's few pairs through expert_gemv, more through the grouped kernel."""
    if few_pairs(*experts.shape, gate_up.shape[0]):
        h = expert_gemv.gate_up(x.contiguous(), gate_up, experts)
        return expert_gemv.down(h, down, experts, weights, residual)
    y = grouped_experts(x, gate_up, down, weights, experts)
    return y if residual is None else residual + y


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """`fused_experts` through the grouped kernel, at any batch."""
    tokens, top_k = experts.shape
    pairs = tokens * top_k
    slots, block_expert = align(experts, gate_up.shape[0])
    h = silu_mul(_grouped(x.contiguous(), gate_up, slots, block_expert, pairs, top_k, tokens=True))
    y = _grouped(h, down, slots, block_expert, pairs, top_k, tokens=False,
                 weights=weights.reshape(-1).to(torch.float32).contiguous())
    return sum_pairs(y, top_k)


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear,
                             reduce=model._same) -> torch.Tensor:
    """nanoinfer.model.decoder's, a sparse layer's experts through `route` and `fused_experts` (no host sync: CUDA
    graphs capture it), its residual add and norm in one kernel; a dense layer's through CUDA's fused layer parts."""
    if lp.moe is None:  # (a dense layer: CUDA's fused parts)
        return fused_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, reduce)
    x, h = add_rms_norm(x.contiguous(), reduce(linear(attn.reshape(x.shape[0], cfg.q_size), lp.o_proj)), lp.mlp_norm,
                        cfg.rms_norm_eps)
    weights, experts = route(linear(h, lp.moe.router), cfg.experts_per_token, cfg.norm_topk_prob)
    if reduce is model._same:  # (one rank: the residual added in the experts' last kernel)
        return fused_experts(h, lp.moe.gate_up, lp.moe.down, weights, experts, residual=x)
    return x + reduce(fused_experts(h, lp.moe.gate_up, lp.moe.down, weights, experts))
