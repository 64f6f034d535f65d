"""Token bitmasks: a step's rows of allowed tokens (int32 words, bit t of word t // 32 set: token t allowed), made on
the host, filled by a grammar's matcher, and applied to the logits (the reference of CUDA's fused kernel,
nanoinfer/backends/cuda/bitmask_triton.py).
"""

from __future__ import annotations

import torch


def allocate_bitmask(rows: int, vocab_size: int, every_token: bool = True) -> torch.Tensor:
    """A host bitmask for `rows` sequences (pinned where CUDA is, for an asynchronous copy):
    every token allowed, or with `every_token=False` left as the allocator gives it (for rows
    that will all be filled). Filled by numpy, on this thread: torch's `fill_` of a mask this
    size runs on its OpenMP threads, which then spin for a while on the cores llguidance's
    threads fill the masks on (measured on a 16-core H100 host: each row's fill 2-3x slower)."""
    bitmask = torch.empty((rows, (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=torch.cuda.is_available())
    if every_token:
        bitmask.numpy().fill(-1)
    return bitmask


def fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of host int32 `bitmask`: what `matcher` allows next. (llguidance.torch has
    this too, but importing it imports torch.compile's machinery: seconds, holding the GIL.)"""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool: token t allowed (bit t % 32 of word t // 32;
    tokens past the words' bits are not)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 copy of `logits` [n, vocab] where every token the `bitmask` [m, words] (on
    the same device) does not allow is -inf: in rows `rows` [m] (int64), or in every row
    (m = n). A copy: the raw logits stay what logprobs report. The reference of CUDA's
    fused kernel (nanoinfer/backends/cuda/bitmask_triton.py).
    (llguidance.torch has one too, but torch.compile'd: a C++ compiler on the CPU and a
    compile per new shape, for what is a few tensor ops.)"""
    out = logits.to(torch.float32, copy=True)
    disallowed = ~unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        return out.masked_fill_(disallowed, float("-inf"))
    out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(disallowed, float("-inf")))
    return out
