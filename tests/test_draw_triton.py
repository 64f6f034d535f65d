"""The Triton draw (nanoinfer/backends/cuda/draw_triton.py) against its oracle, nanoinfer.sampling.draw.random_draw: the same token per row.

Needs CUDA and Triton; skipped cleanly without them. With TRITON_INTERPRET=1 the kernels run on
CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton:. pytest ...).
tests/test_gpu.py runs the same comparison on CUDA, inside a captured CUDA graph too.

The probabilities are distinct random floats: the interpreter's log (numpy's) differs from
torch's CPU log by up to 4 ULP on a fifth of the 2**23 uniforms, which could reorder two
tokens whose p / E lie within those ULPs; distinct random probabilities make that a 1e-6 event
per row, while equal probabilities tie whenever two tokens' uniforms do. (On CUDA both sides
call libdevice's logf.) The uniforms themselves are compared bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from nanoinfer.sampling.draw import random_draw, uniform_noise  # noqa: E402
from nanoinfer.backends.cuda.draw_triton import _row_key, _uniform, triton_draw  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="the Triton draw needs CUDA")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Seeds as SamplingParams.with_seed wraps them into int64: negative ones feed ones into the
# hash's arithmetic shift; steps past 2**32 are cut to their low half by the hash.
EDGE_SEEDS = [0, 1, -1, 2**32, 2**32 - 1, -(2**32), 2**63 - 1, -(2**63), 0x27D4_EB2F, -123456789012345]


def seeds_and_steps(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    seeds[: len(EDGE_SEEDS)] = torch.tensor(EDGE_SEEDS[:rows])
    steps = torch.randint(0, 5000, (rows,), generator=gen)
    steps[-1:] = 2**40 + 3
    return seeds.to(DEVICE), steps.to(DEVICE)


def random_probs(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random probabilities, sharpened as a model's are, with the masks a sampler
    leaves: top-k zeros (k varying by row), a row with one nonzero token (past the first chunk
    in a large vocabulary), a row whose only nonzero token is the last, and a row all zeros
    (torch's argmax: token 0)."""
    probs = torch.rand(rows, vocab, generator=gen) ** 8
    ks = torch.randint(1, vocab + 1, (rows,), generator=gen)
    ks[0] = vocab  # one row unmasked
    kth = probs.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
    probs = torch.where(probs >= kth, probs, 0.0)
    if rows > 1:
        probs[1] = 0.0
        probs[1, vocab * 2 // 3] = 0.25
    if rows > 2:
        probs[2] = 0.0
        probs[2, vocab - 1] = 1.0
    if rows > 3:
        probs[3] = 0.0
    return (probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)).to(DEVICE)


@pytest.mark.parametrize("rows, vocab", [(1, 97), (1, 49152 + 7), (5, 4096), (6, 4097), (70, 1000), (9, 49152 + 7)])
def test_tokens_equal_random_draw(rows, vocab):
    gen = torch.Generator().manual_seed(rows * 100003 + vocab)
    probs = random_probs(rows, vocab, gen)
    seeds, steps = seeds_and_steps(rows, gen)
    expected = random_draw(probs, seeds, steps)
    assert torch.equal(triton_draw(probs, seeds, steps), expected)
    if rows > 3:
        assert expected[1].item() == vocab * 2 // 3 and expected[2].item() == vocab - 1 and expected[3].item() == 0


def test_views_and_dtypes():
    """A row slice of a wider buffer (row stride > vocab), bf16 probabilities (torch promotes
    p / E to fp32, the kernel loads p as fp32: the same quotient), seeds from a column."""
    gen = torch.Generator().manual_seed(7)
    wide = random_probs(11, 3000, gen)
    probs = wide[:, :2900]
    packed = torch.stack(seeds_and_steps(11, gen))  # [2, rows]: seeds and steps as one tensor's rows
    seeds, steps = packed[0], packed[1]
    assert probs.stride(0) == 3000
    assert torch.equal(triton_draw(probs, seeds, steps), random_draw(probs, seeds, steps))
    half = probs.to(torch.bfloat16)
    assert torch.equal(triton_draw(half, seeds, steps), random_draw(half, seeds, steps))


def test_no_rows():
    probs = torch.rand(0, 50, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = triton_draw(probs, empty, empty)
    assert out.shape == (0,) and out.dtype == torch.int64


def test_different_seeds_and_steps_draw_differently():
    """Uniform rows (every token as likely): 64 (seed, step) pairs draw many different tokens,
    and the same pair twice draws the same one."""
    rows, vocab = 64, 1000
    probs = torch.full((rows, vocab), 1.0 / vocab, device=DEVICE)
    seeds = torch.arange(rows, device=DEVICE) // 2 * 7919
    steps = torch.arange(rows, device=DEVICE) % 2
    tokens = triton_draw(probs, seeds, steps)
    assert len(set(tokens.tolist())) > 48
    assert torch.equal(tokens, triton_draw(probs, seeds, steps))


@triton.jit
def _noise_kernel(seeds_ptr, steps_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    u = _uniform(_row_key(seeds_ptr, steps_ptr, row), offs)
    tl.store(out_ptr + row * vocab + offs, u, mask=offs < vocab)


def test_noise_bit_for_bit():
    """The kernel's uniforms are `uniform_noise`'s, every bit (both are exact: (k + 1/2) / 2**23)."""
    rows, vocab, block = 12, 3000, 1024
    seeds, steps = seeds_and_steps(rows, torch.Generator().manual_seed(3))
    out = torch.empty(rows, vocab, device=DEVICE)
    _noise_kernel[(rows, triton.cdiv(vocab, block))](seeds, steps, out, vocab, BLOCK=block)
    expected = uniform_noise(seeds, steps, vocab)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
