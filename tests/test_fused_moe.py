"""CUDA's grouped-expert kernels (nanoinfer/backends/cuda/fused_moe.py) against the experts' reference loop
(skipped without CUDA and Triton).

The pairs' layout (`align`): every pair in exactly one slot, in its expert's run of whole blocks, each block's
expert the run's. The product: close to nanoinfer.model.moe.experts_reference in fp32 on the same weights, at one
token (decode: only its k experts' blocks do work) and at many; and a token's output has the same bits alone and
in any batch (no atomics: a token's k products add in a fixed order)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from nanoinfer.backends.cuda.fused_moe import BLOCK_M, align, fused_experts  # noqa: E402
from nanoinfer.model.moe import MoEParams, experts_reference, route  # noqa: E402


def moe(experts: int, hidden: int, inter: int, seed: int = 0) -> MoEParams:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return MoEParams(torch.randn(experts, hidden, device="cuda", generator=g),
                     torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.05,
                     torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.05)


@pytest.mark.parametrize("tokens,k,experts", [(1, 2, 8), (1, 8, 64), (7, 2, 8), (300, 8, 64)])
def test_align_puts_each_pair_in_its_experts_blocks(tokens, k, experts):
    chosen = torch.stack([torch.randperm(experts, device="cuda")[:k] for _ in range(tokens)])
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
    x = torch.randn(tokens, 256, device="cuda")
    weights, chosen = route(x @ p.router.T, k, renormalize=True)
    want = experts_reference(x, p, weights, chosen)  # (fp32)
    bf16 = MoEParams(p.router, p.gate_up.bfloat16(), p.down.bfloat16())
    got = fused_experts(x.bfloat16(), bf16.gate_up, bf16.down, weights, chosen)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.02 * float(want.abs().max()), rtol=0.02)


def test_a_tokens_output_is_the_same_alone_and_in_a_batch():
    p = moe(16, 256, 128, seed=1)
    x = torch.randn(64, 256, device="cuda").bfloat16()
    weights, chosen = route(x.float() @ p.router.T, 4, renormalize=False)
    gate_up, down = p.gate_up.bfloat16(), p.down.bfloat16()
    whole = fused_experts(x, gate_up, down, weights, chosen)
    for t in (0, 17, 63):
        alone = fused_experts(x[t:t + 1], gate_up, down, weights[t:t + 1], chosen[t:t + 1])
        assert torch.equal(alone, whole[t:t + 1]), t
