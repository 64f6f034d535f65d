"""The Triton grammar mask (nanoinfer/backends/cuda/bitmask_triton.py) against its reference, nanoinfer.structured.bitmasks.apply_bitmask.

Needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton on the path: the kernel then runs on
CPU tensors); skipped cleanly without them. Equal bit for bit: both copy the logits to float32
and write -inf where a bit is clear.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nanoinfer.backends.cuda.bitmask_triton import masked_float_logits  # noqa: E402
from nanoinfer.structured.bitmasks import apply_bitmask

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="the Triton mask needs CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_bitmask(rows: int, words: int, gen: torch.Generator, density: float) -> torch.Tensor:
    bits = (torch.rand(rows, words * 32, generator=gen) < density).to(torch.int64)
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # (bit 31: the sign)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab,words", [(151936, 4748), (5000, 157), (5000, 150), (33, 2)])
@pytest.mark.parametrize("masked_rows", [None, [2], [0, 3, 1]])
def test_masked_float_logits_equal_the_reference(dtype, vocab, words, masked_rows):
    gen = torch.Generator().manual_seed(vocab + words)
    logits = (torch.randn(4, vocab, generator=gen) * 5).to(dtype)
    m = 4 if masked_rows is None else len(masked_rows)
    for density in (0.0, 0.01, 0.6, 1.0):
        bitmask = random_bitmask(m, words, gen, density)
        rows = None if masked_rows is None else torch.tensor(masked_rows)
        expected = apply_bitmask(logits, bitmask, rows)
        got = masked_float_logits(logits.to(DEVICE), bitmask.to(DEVICE), None if rows is None else rows.to(DEVICE))
        assert got.dtype == torch.float32 and torch.equal(got.cpu(), expected), (density, masked_rows)


def test_no_masked_row_is_the_float_copy():
    logits = torch.randn(3, 100, dtype=torch.bfloat16).to(DEVICE)
    got = masked_float_logits(logits, torch.zeros((0, 4), dtype=torch.int32, device=DEVICE),
                              torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(got, logits.float())
