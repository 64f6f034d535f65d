"""The sampler's random draw on CUDA as a Triton kernel: `nanoinfer.sampling.draw.random_draw`'s exponential race, fused.

The eager draw makes ~40 passes over [rows, vocab] int64 tensors to hash (seed, step, token
id) into noise; here each program hashes its tokens in registers while it reads their
probabilities once, and keeps its chunk's winner. As in nanoinfer/backends/cuda/argmax.py a row is cut into
chunks of CHUNK tokens, one program each (batch 1 over a 152k vocabulary: 38 programs rather
than one looping over the row), and a second tiny kernel picks each row's winner among its
chunks. It replaces a torch.compile'd `random_draw`, whose Inductor compile cost seconds of
every start; Triton's JIT compiles this once and caches it on disk.

The tokens equal `random_draw`'s exactly (the oracle, tests/test_draw_triton.py):
- the hash: the seed's first mix stays in int64 as torch's does (the arithmetic shift brings a
  negative seed's sign bits into it); from there on every value lies in [0, 2**32), where
  uint32's wrapping multiply is `_mul32` and its logical shift is torch's;
- the float steps are torch's: the uniform is exact, `tl.log` lowers to libdevice's logf, the
  same function torch's CUDA log calls, and `tl.div_rn` rounds as torch's division does (a
  plain `/` on fp32 lowers to an approximate division);
- ties go to the lowest token id, as torch's argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda.argmax import NO_INDEX, chunk_winners, first_max

CHUNK = 4096  # tokens per program (4 loads of BLOCK, 43 registers a thread on sm_90 at 8 warps)
BLOCK = 1024


@triton.jit
def _mix32_tail(x):
    """`_mix32` after its first xor-shift, on uint32 (wrapping multiplies, logical shifts)."""
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _mix32(x):
    """nanoinfer.sampling.draw._mix32 of a uint32 tensor."""
    return _mix32_tail(x ^ (x >> 16))


@triton.jit
def _row_key(seeds_ptr, steps_ptr, row):
    """The row's 32-bit key of (seed, step), as `uniform_noise` computes it, in uint32."""
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    step = tl.load(steps_ptr + row).to(tl.int64)
    # torch mixes mix32(seed & MASK) ^ (seed >> 32) in int64: a negative seed's shift brings
    # ones into bits 32..47, which the first xor-shift moves into the low half.
    x = _mix32(seed.to(tl.uint32)).to(tl.int64) ^ (seed >> 32)
    key = _mix32_tail((x ^ (x >> 16)).to(tl.uint32))
    return _mix32(key + step.to(tl.uint32) * 0x9E3779B9)


@triton.jit
def _uniform(key, tokens):
    """`uniform_noise` of the row keyed `key` at int32 token ids: (k + 1/2) / 2**23, exact in fp32."""
    bits = _mix32(_mix32(key ^ _mix32(tokens.to(tl.uint32))) + key)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608)


@triton.jit
def _chunk_kernel(probs_ptr, seeds_ptr, steps_ptr, val_ptr, idx_ptr, vocab, stride_row, num_chunks,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    key = _row_key(seeds_ptr, steps_ptr, row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], NO_INDEX, tl.int32)
    for start in tl.range(0, CHUNK, BLOCK):  # (unrolled, the hash took 196 registers a thread: sm_90, 4 warps)
        offs = chunk * CHUNK + start + tl.arange(0, BLOCK)
        valid = offs < vocab
        p = tl.load(probs_ptr + row.to(tl.int64) * stride_row + offs, mask=valid, other=0.0).to(tl.float32)
        ratio = tl.where(p > 0, tl.div_rn(p, -tl.log(_uniform(key, offs))), -1.0)
        ratio = tl.where(valid, ratio, float("-inf"))  # past the vocabulary: below a masked token's -1
        take = ratio > best  # strictly: each lane keeps its first index of its largest value
        best = tl.where(take, ratio, best)
        best_idx = tl.where(take, offs, best_idx)
    top, first = first_max(best, best_idx)
    tl.store(val_ptr + row * num_chunks + chunk, top)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _combine_kernel(val_ptr, idx_ptr, token_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    _, token = chunk_winners(val_ptr, idx_ptr, row, num_chunks, CHUNKS)
    tl.store(token_ptr + row, token.to(tl.int64))


def triton_draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`random_draw(probs, seeds, steps)`: probs [rows, vocab] (any float dtype, on CUDA), seeds
    and steps [rows] int64 -> int64 tokens [rows]. No host sync and nothing kept between calls
    (CUDA graphs may capture it); the row count is the grid's, so any count runs one compiled kernel."""
    rows, vocab = probs.shape
    probs = probs if probs.stride(1) == 1 else probs.contiguous()
    seeds, steps = seeds.contiguous(), steps.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    val = torch.empty((rows, chunks), dtype=torch.float32, device=probs.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=probs.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows:
        _chunk_kernel[(rows, chunks)](probs, seeds, steps, val, idx, vocab, probs.stride(0), chunks,
                                      CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
        _combine_kernel[(rows,)](val, idx, tokens, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return tokens
