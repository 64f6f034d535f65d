"""Decode attention over an fp8 (e4m3) pool for GQA groups of 1 or 2, on CUDA cores: no tensor-core padding.

TritonPagedAttention's kernel runs a 16-row tensor-core tile per (sequence, KV head); for a
decode query of a group of 2 that is 14 rows of padding in every q.K^T, exp2 and P.V, and with
e4m3's half-size K/V it is bound by that work, not by bytes (bench/RESULTS.md: an H200 at
256 decoding sequences read fp8 K/V at 2.0 TB/s, bf16 at 4.0). Here one program per
(sequence, KV head[, context partition]) serves the group's query rows (1 or 2) with plain
multiply-adds, each K/V tile loaded once:

- The key tile is [W, R, D]: W key lanes across threads and warps, R keys inside a thread,
  head_dim across the lanes of 16-byte vectors. Key n of a tile is start + r * W + w.
- Each key lane keeps its own running max, sum and accumulator (a partition of one lane), so
  the loop needs no cross-lane reduction but q.k's sum over head_dim; the lanes merge once
  at the end.
- e4m3 widens to fp16; q.k's products and in-thread partial sums (8 terms) and P.V's sum over
  a thread's R keys are fp16 multiply-adds; every sum across threads and every running sum
  is fp32.
- K/V loads go through shared memory `num_stages` deep (`tl.range`): Triton pipelines only
  loads that feed a tl.dot on its own.
- Split (small batches): partitions of the context write (max, sum, acc) into
  TritonPagedAttention's workspaces, merged by its `_reduce_partitions_kernel`.

Measured on an H200 (bench/RESULTS.md, 2026-11-24): 256 sequences of 100-1100 tokens, 8 KV
heads of 128: 110 us a layer against 172 (the tensor-core kernel, fp8) and 93 (a kernel that
only loads the same bytes). tests/test_triton_attention.py holds it to the fp32 reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoinfer.attention.triton_softmax import online_softmax

_LOG2E = 1.4426950408889634
KEYS_PER_THREAD, NUM_WARPS, STAGES = 8, 2, 3  # the best of 4-8 keys, 2-8 warps, 1-3 stages measured


@triton.jit
def _scores(k, q, R: tl.constexpr, W: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, VEC: tl.constexpr):
    """q.k for the tile's keys [W, R]: fp16 products summed in pairs and then in eights inside
    the thread, fp32 across threads."""
    t = tl.reshape(k * q[None, None, :], [W, R, HEAD_DIM_PAD // VEC, VEC // 2, 2])
    return tl.sum(tl.sum(tl.sum(t, 3).to(tl.float32), 3), 2)


@triton.jit
def _online_step(s, k_valid, m, l, acc, v):
    """Each key lane's online softmax over its R keys of the tile (base 2)."""
    m_new, alpha, p = online_softmax(tl.where(k_valid, s, float("-inf")), m)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p.to(tl.float16)[:, :, None] * v, 1).to(tl.float32)
    return m_new, l, acc


@triton.jit
def _finish(m, l, acc, out_row, ws, m_ptr, l_ptr, acc_ptr, offs_d, d_valid, HEAD_DIM: tl.constexpr,
            SPLIT: tl.constexpr):
    """Merge the key lanes (each with its own max); the output, or the partition's partials."""
    big = tl.max(m, 0)
    w = tl.exp2(m - tl.where(big == float("-inf"), 0.0, big))
    total = tl.sum(l * w, 0)
    a = tl.sum(acc * w[:, None], 0)
    if SPLIT:
        tl.store(m_ptr + ws, big)
        tl.store(l_ptr + ws, total)
        tl.store(acc_ptr + ws * HEAD_DIM + offs_d, a, mask=d_valid)
    else:
        o = a / tl.where(total == 0.0, 1.0, total)
        tl.store(out_row + offs_d, o.to(out_row.dtype.element_ty), mask=d_valid)


@triton.jit
def _decode_cc_kernel(
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, m_ptr, l_ptr, acc_ptr,
    num_seqs, num_tokens, qk_scale, window, part_size, max_partitions,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_blk, stride_slot, stride_kvh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, R: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr, SLIDING: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    head0 = kv_head * GROUP
    if not SPLIT:  # padding rows past the last sequence's queries: zeros (the reduce kernel does it when split)
        if pid >= tl.load(query_start_loc_ptr + num_seqs):
            if pid < num_tokens:
                zero = tl.zeros([HEAD_DIM_PAD], out_ptr.dtype.element_ty)
                for g in tl.static_range(GROUP):
                    tl.store(out_ptr + pid * stride_ot + (head0 + g) * stride_oh + offs_d, zero, mask=d_valid)
    if pid >= num_seqs:
        return
    seq = pid
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context_len = tl.load(seq_lens_ptr + seq)
    offs_r = tl.arange(0, R)
    offs_w = tl.arange(0, W)
    kv_base = kv_ptr + kv_head * stride_kvh
    TILE: tl.constexpr = R * W
    for qi in tl.range(0, num_queries):  # one in a decode step (correct, if slow, for more)
        token = q_start + qi
        q_pos = context_len - num_queries + qi
        kv_hi = q_pos + 1
        kv_lo = 0
        if SLIDING:
            kv_lo = tl.maximum(q_pos - window + 1, 0)
        tile_lo = (kv_lo // TILE) * TILE
        if SPLIT:  # part_size is a multiple of TILE: tiles never straddle partitions
            tile_lo = tl.maximum(tile_lo, part * part_size)
            kv_hi = tl.minimum(kv_hi, (part + 1) * part_size)
        qrow = q_ptr + token * stride_qt + head0 * stride_qh + offs_d
        q0 = tl.load(qrow, mask=d_valid, other=0.0).to(tl.float32) * qk_scale
        q1 = q0
        if GROUP == 2:
            q1 = tl.load(qrow + stride_qh, mask=d_valid, other=0.0).to(tl.float32) * qk_scale
        q0 = tl.clamp(q0, -65504.0, 65504.0).to(tl.float16)
        q1 = tl.clamp(q1, -65504.0, 65504.0).to(tl.float16)
        m0 = tl.full([W], float("-inf"), tl.float32)
        m1 = tl.full([W], float("-inf"), tl.float32)
        l0 = tl.zeros([W], tl.float32)
        l1 = tl.zeros([W], tl.float32)
        acc0 = tl.zeros([W, HEAD_DIM_PAD], tl.float32)
        acc1 = tl.zeros([W, HEAD_DIM_PAD], tl.float32)
        for start in tl.range(tile_lo, kv_hi, TILE, num_stages=STAGES):
            k_pos = start + offs_r[None, :] * W + offs_w[:, None]  # [W, R]
            k_valid = k_pos < kv_hi
            if SLIDING:
                k_valid &= k_pos >= kv_lo
            block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
            k_off = block.to(tl.int64) * stride_blk + (k_pos % BLOCK_SIZE) * stride_slot
            ptrs = kv_base + k_off[:, :, None] + offs_d[None, None, :]
            mask = k_valid[:, :, None] & d_valid[None, None, :]
            k = tl.load(ptrs, mask=mask, other=0.0).to(tl.float16)
            v = tl.load(ptrs + stride_kv, mask=mask, other=0.0).to(tl.float16)
            m0, l0, acc0 = _online_step(_scores(k, q0, R, W, HEAD_DIM_PAD, VEC), k_valid, m0, l0, acc0, v)
            if GROUP == 2:
                m1, l1, acc1 = _online_step(_scores(k, q1, R, W, HEAD_DIM_PAD, VEC), k_valid, m1, l1, acc1, v)
        out_row = out_ptr + token * stride_ot + head0 * stride_oh
        ws = (token * NUM_HEADS + head0) * max_partitions + part
        _finish(m0, l0, acc0, out_row, ws, m_ptr, l_ptr, acc_ptr, offs_d, d_valid, HEAD_DIM, SPLIT)
        if GROUP == 2:
            _finish(m1, l1, acc1, out_row + stride_oh, ws + max_partitions, m_ptr, l_ptr, acc_ptr, offs_d, d_valid,
                    HEAD_DIM, SPLIT)


def takes(group: int, head_dim_pad: int) -> bool:
    """Shapes this kernel serves (measured for groups of 2 and heads of 128)."""
    return group in (1, 2) and head_dim_pad <= 128


def keys_per_tile(head_dim_pad: int) -> int:
    """Keys one loop iteration covers (a split's partition size is a multiple of it)."""
    return KEYS_PER_THREAD * 32 * NUM_WARPS // (head_dim_pad // 16)


def decode_attention(q, kv_layer, out, block_tables, seq_lens, query_start_loc, scale, window, head_dim_pad,
                     num_parts, part_size, workspaces, max_partitions):
    """q, out: [tokens, heads, head_dim]; kv_layer: [2, blocks, block_size, kv_heads, head_dim]
    e4m3. num_parts > 1: each program covers `part_size` keys of the context and writes into
    `workspaces` (max, sum, acc); the caller reduces them."""
    tokens, heads, d = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    split = num_parts > 1
    m_ws, l_ws, acc_ws = workspaces
    vec = 16 // kv_layer.element_size()
    _decode_cc_kernel[(max(seq_lens.shape[0], tokens), kv_heads, num_parts)](
        q, kv_layer, out, block_tables, seq_lens, query_start_loc, m_ws, l_ws, acc_ws,
        seq_lens.shape[0], tokens, scale * _LOG2E, window, part_size, max_partitions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), kv_layer.stride(3), block_tables.stride(0),
        NUM_HEADS=heads, GROUP=heads // kv_heads, HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        R=KEYS_PER_THREAD, W=32 * NUM_WARPS // (head_dim_pad // vec), VEC=vec, SLIDING=window > 0,
        STAGES=STAGES, SPLIT=split, num_warps=NUM_WARPS, num_stages=1)
