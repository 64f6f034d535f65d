"""Grammar masks onto the logits on CUDA: `nanoinfer.structured.bitmasks.apply_bitmask` in one Triton kernel.

The reference unpacks the packed bitmask into a [rows, vocab] bool tensor and fills through it,
with a gather and a scatter when only some rows are masked: ~9 launches, ~0.3 ms of the host's
time a masked step on an H100's host (bench/RESULTS.md), where the device's work is a few µs.
Here the float copy is one torch op and the mask one kernel: each program reads its chunk's
words once and writes -inf only where a token is not allowed. Tokens past the bitmask's bits
are not allowed, as in the reference (tests/test_bitmask_triton.py: equal, bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens per program: 38 programs a row over a 152k vocabulary


@triton.jit
def _disallow_kernel(out_ptr, bitmask_ptr, rows_ptr, vocab, words, stride_out, stride_mask,
                     HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + i) if HAS_ROWS else i
    tokens = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < vocab
    word = tl.load(bitmask_ptr + i.to(tl.int64) * stride_mask + tokens // 32, mask=valid & (tokens < words * 32),
                   other=0)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(out_ptr + row.to(tl.int64) * stride_out + tokens, float("-inf"), mask=valid & ~allowed)


def masked_float_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`apply_bitmask(logits, bitmask, rows)`: a float32 copy of `logits` [n, vocab] whose tokens
    the bitmask [m, words] int32 does not allow are -inf, in rows `rows` [m] int64 (None: every
    row, m = n). All on one CUDA device; nothing waits for it (CUDA graphs may capture it)."""
    out = logits.to(torch.float32, copy=True)
    m, vocab = bitmask.shape[0], logits.shape[1]
    if m:
        bitmask = bitmask if bitmask.stride(1) == 1 else bitmask.contiguous()
        _disallow_kernel[(m, triton.cdiv(vocab, BLOCK))](
            out, bitmask, rows if rows is not None else bitmask, vocab, bitmask.shape[1], out.stride(0),
            bitmask.stride(0), HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=8)
    return out
