"""CUDA's expert kernels (nanoinfer/backends/cuda/fused_moe.py's grouped kernel, expert_gemv.py's decode GEMVs)
against the experts' reference loop (skipped without CUDA and Triton; with TRITON_INTERPRET=1 they run on CPU tensors
in Triton's interpreter, in fp16: its bf16 tl.dot is no oracle).

The pairs' layout (`align`): every pair in exactly one slot, in its expert's run of whole blocks, each block's
expert the run's. The product: close to nanoinfer.model.moe.experts_reference in fp32 on the same weights, at one
token (decode: only its k experts' rows are read) and at many; the decode GEMVs close to the grouped kernel; and
within each kernel a token's output has the same bits alone and in any batch (no atomics: a token's k products
add in a fixed order)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from nanoinfer.backends.cuda import expert_gemv  # noqa: E402
from nanoinfer.backends.cuda.fused_moe import BLOCK_M, align, few_pairs, fused_experts, grouped_experts  # noqa: E402
from nanoinfer.model.moe import MoEParams, experts_reference, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.float16 if INTERPRET else torch.bfloat16


def moe(experts: int, hidden: int, inter: int, seed: int = 0) -> MoEParams:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return MoEParams(torch.randn(experts, hidden, device=DEVICE, generator=g),
                     torch.randn(experts, 2 * inter, hidden, device=DEVICE, generator=g) * 0.05,
                     torch.randn(experts, hidden, inter, device=DEVICE, generator=g) * 0.05)


@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 8), (1, 8, 64), (7, 2, 8), (300, 8, 64)])
def test_align_puts_each_pair_in_its_experts_blocks(tokens, k, experts):
    chosen = torch.stack([torch.randperm(experts, device=DEVICE)[:k] for _ in range(tokens)])
    slots, block_expert = align(chosen, experts)
    pairs = tokens * k
    held = slots[slots < pairs]
    assert sorted(held.tolist()) == list(range(pairs))
    for block, expert in enumerate(block_expert.tolist()):
        in_block = slots[block * BLOCK_M:(block + 1) * BLOCK_M]
        real = in_block[in_block < pairs].long()
        if expert == experts:
            assert real.numel() == 0
        else:
            assert (chosen.reshape(-1)[real] == expert).all()
    # (at most min(experts, pairs) runs, each padded by under a block: a decode's k pairs take k blocks)
    assert slots.numel() == -(-(pairs + min(experts, pairs) * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M


@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 8), (1, 8, 64), (33, 2, 8), (300, 8, 64)])
def test_fused_experts_match_the_reference(tokens, k, experts):
    p = moe(experts, 256, 128)
    x = torch.randn(tokens, 256, device=DEVICE)
    weights, chosen = route(x @ p.router.T, k, renormalize=True)
    want = experts_reference(x, p, weights, chosen)  # (fp32)
    half = MoEParams(p.router, p.gate_up.to(HALF), p.down.to(HALF))
    got = fused_experts(x.to(HALF), half.gate_up, half.down, weights, chosen)
    assert got.dtype == HALF
    torch.testing.assert_close(got.float(), want, atol=0.02 * float(want.abs().max()), rtol=0.02)
    # (fp32 weights: both kernels sum in IEEE fp32 - no TF32 in the grouped kernel's tensor-core products)
    torch.testing.assert_close(fused_experts(x, p.gate_up, p.down, weights, chosen), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 8), (1, 8, 64), (4, 8, 128), (3, 2, 8)])
def test_the_decode_gemvs_agree_with_the_grouped_kernel_and_add_the_residual(tokens, k, experts):
    p = moe(experts, 256, 96, seed=2)  # (an inner width no tile divides)
    x = torch.randn(tokens, 256, device=DEVICE).to(HALF)
    weights, chosen = route(x.float() @ p.router.T, k, renormalize=True)
    gate_up, down = p.gate_up.to(HALF), p.down.to(HALF)
    gemv = expert_gemv.down(expert_gemv.gate_up(x, gate_up, chosen), down, chosen, weights)
    grouped = grouped_experts(x, gate_up, down, weights, chosen)
    torch.testing.assert_close(gemv.float(), grouped.float(), atol=0.01 * float(grouped.abs().max()), rtol=0.01)
    with_residual = expert_gemv.down(expert_gemv.gate_up(x, gate_up, chosen), down, chosen, weights, residual=x)
    assert torch.equal(with_residual, x + gemv)  # (the eager add's one rounding)
    if few_pairs(tokens, k, experts):
        assert torch.equal(fused_experts(x, gate_up, down, weights, chosen, residual=x), with_residual)


@pytest.mark.parametrize("kernel,tokens", [("grouped", 64), ("gemv", 4)])
def test_a_tokens_output_is_the_same_alone_and_in_a_batch(kernel, tokens):
    p = moe(16, 256, 128, seed=1)
    x = torch.randn(tokens, 256, device=DEVICE).to(HALF)
    weights, chosen = route(x.float() @ p.router.T, 4, renormalize=False)
    gate_up, down = p.gate_up.to(HALF), p.down.to(HALF)

    def experts(rows: slice) -> torch.Tensor:
        if kernel == "grouped":
            return grouped_experts(x[rows], gate_up, down, weights[rows], chosen[rows])
        return expert_gemv.down(expert_gemv.gate_up(x[rows], gate_up, chosen[rows]), down, chosen[rows], weights[rows])

    whole = experts(slice(None))
    for t in (0, tokens // 2, tokens - 1):
        assert torch.equal(experts(slice(t, t + 1)), whole[t:t + 1]), t


@pytest.mark.parametrize("form", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_int8_and_fp8_stacks_give_their_numbers_products(form, tokens):
    """An ExpertStack through either kernel (1 and 3 tokens: the decode GEMVs; 40: the grouped kernel): the
    reference's sum over the float stacks its numbers stand for (weight-only: activations as they are)."""
    from nanoinfer.quant.quantized import ExpertStack, Fp8Weight, Int8Weight, dequantize

    p = moe(16, 256, 96, seed=3)
    x = torch.randn(tokens, 256, device=DEVICE)
    weights, chosen = route(x @ p.router.T, 4, renormalize=True)
    stacks = [ExpertStack.quantize(w, Int8Weight if form == "int8" else Fp8Weight) for w in (p.gate_up, p.down)]
    floats = [torch.stack([dequantize(s[e]) for e in range(s.shape[0])]) for s in stacks]
    want = experts_reference(x, MoEParams(p.router, *floats), weights, chosen)  # (fp32)
    got = fused_experts(x.to(HALF), *stacks, weights, chosen)
    torch.testing.assert_close(got.float(), want, atol=0.02 * float(want.abs().max()), rtol=0.02)
    if tokens <= 3:  # (both kernels, side by side)
        grouped = grouped_experts(x.to(HALF), *stacks, weights, chosen)
        torch.testing.assert_close(got.float(), grouped.float(), atol=0.01 * float(want.abs().max()), rtol=0.01)


@pytest.mark.parametrize("tokens,experts,k,renormalize", [(1, 128, 8, True), (5, 8, 2, True), (3, 60, 6, False),
                                                          (33, 16, 1, False)])
def test_the_routing_kernel_picks_the_references_experts(tokens, experts, k, renormalize):
    """fused_moe.route against nanoinfer.model.moe.route: the same experts in the same order (distinct logits:
    torch.topk leaves the order of equal ones unspecified), their weights within fp32's rounding of the softmax;
    among equal probabilities the kernel takes the lower index first."""
    from nanoinfer.backends.cuda.fused_moe import route as route_kernel

    g = torch.Generator().manual_seed(tokens)
    logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).float().mul(0.05).to(DEVICE)
    want_weights, want_experts = route(logits, k, renormalize)
    weights, chosen = route_kernel(logits, k, renormalize)
    assert chosen.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(chosen, want_experts)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    logits[0, :] = 0.0
    logits[0, experts - 1] = 1.0
    _, chosen = route_kernel(logits, k, renormalize)
    assert chosen[0].tolist() == [experts - 1] + list(range(k - 1))
