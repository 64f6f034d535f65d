"""The CUDA attention backend: Triton kernels for the KV write, paged varlen attention and split-K decode.

Three kernels, all reading the pool in place (no page gather into a dense copy):

- `_write_kv_kernel`: one program per token row copies its k and v into the pool slot
  `slot_mapping[row]`; rows with slot -1 (padding) store nothing.
- `_paged_attention_kernel`: one program per (query tile, kv head[, context partition]).
  A query tile holds BLOCK_Q query tokens of one sequence times the GROUP query heads that
  share one kv head, so each K/V tile gathered through the block table is loaded once and
  reused by the whole GQA group (rows = BLOCK_Q * GROUP). Online softmax in fp32 (base 2),
  flash-attention style. Without split it writes the output; with split (flash-decoding /
  PagedAttention V2) each program covers one partition of the context and writes its
  partial (max, sum, acc) to a workspace,
- `_reduce_partitions_kernel`: combines the partitions of each (token, head) into the output.

A decode step over an fp8 pool with a GQA group of 1 or 2 goes to triton_decode_cc.py's
CUDA-core kernel instead (16-row tensor-core tiles would be mostly padding there).

No host sync anywhere: which program serves which sequence is found on the device (a binary
search over query_start_loc), and every launch size comes from tensor shapes, never values,
so a step can be captured in a CUDA graph. `prepare` does no host work beyond packing
references to the batch's tensors. Any head_dim up to 256 works: a head that is not a power
of two sits in a tile padded to the next one, its extra columns masked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda import pdl
from nanoinfer.attention import triton_decode_cc
from nanoinfer.attention.triton_softmax import online_softmax
from nanoinfer.model.batch import Batch
from nanoinfer.model.config import ModelConfig

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_kv,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    # The pool is [2, num_blocks * block_size (one row per slot), kv_heads, head_dim] contiguous,
    # so a slot is KV_HEADS * HEAD_DIM contiguous elements: one masked vector store per row.
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    mask = (offs < KV_HEADS * HEAD_DIM) & (slot >= 0)
    k = tl.load(k_ptr + row * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + dim, mask=mask)
    dst = kv_ptr + slot * (KV_HEADS * HEAD_DIM) + offs
    if FP8:  # saturate: e4m3 has no infinity, and a value past 448 would otherwise become NaN
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_dim_mask(HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    # Tiles span HEAD_DIM_PAD (tl.arange needs a power of two) columns, the last ones masked.
    # For a power-of-two head_dim the mask is a constant `True` that folds out of every load
    # and store: the compiled kernel is the unpadded one.
    if HEAD_DIM == HEAD_DIM_PAD:
        return tl.full([HEAD_DIM_PAD], 1, tl.int1)
    else:
        return tl.arange(0, HEAD_DIM_PAD) < HEAD_DIM


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1): a bound that
    # needs no host pass over the lengths (at most one tile per sequence is wasted). Return the
    # last s whose first tile is <= `tile`.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # (1 - e^-2|x|) / (1 + e^-2|x|), signed: exp2 of a negative number only, so no overflow at any |x|
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # (2 log2(e))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    m_ptr, l_ptr, acc_ptr,  # split-K workspaces (unused without SPLIT)
    num_seqs, num_tokens, qk_scale, window, num_partitions, max_partitions,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_blk, stride_slot, stride_kvh, stride_bt,
    cap,  # Gemma 2's attention soft-cap in log2 units (softcap * log2(e)); read only with SOFTCAP
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr, SPLIT: tl.constexpr, FP8_KV: tl.constexpr, PDL: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    if PDL:  # (nanoinfer.backends.cuda.pdl)
        pdl.start()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_off = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, in the sequence
    context_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query q_off + r // GROUP of the sequence, for head kv_head*GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_off + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    in_tile = offs_m // GROUP < BLOCK_Q  # BLOCK_M need not be a multiple of GROUP
    row_valid = in_tile & (q_idx < num_queries)
    token = q_start + q_idx
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = _head_dim_mask(HEAD_DIM, HEAD_DIM_PAD)[None, :]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if q_off >= num_queries:
        # Tiles past the last sequence's queries zero the padding rows (as the reference does),
        # so every output row is written without a memset launch. The split path leaves that
        # to the reduce kernel.
        if not SPLIT:
            if seq == num_seqs - 1:
                pad = in_tile & (token < num_tokens)
                tl.store(out_ptrs, tl.zeros([BLOCK_M, HEAD_DIM_PAD], out_ptr.dtype.element_ty),
                         mask=pad[:, None] & d_valid)
        return

    # Padded columns load as 0: they add nothing to q.k, and p @ v gives 0 there.
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid, other=0.0)
    if FP8_KV:
        # An fp8 pool's tiles widen to fp16, the one conversion Hopper does in a single
        # instruction (e4m3 -> bf16 takes a detour that made the kernel compute-bound); the
        # queries follow, clamped into fp16's range.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    # Query i of the chunk sits at position context_len - num_queries + i (causal over the cache).
    q_pos = context_len - num_queries + q_idx
    last_q = tl.minimum(q_off + BLOCK_Q, num_queries) - 1
    kv_hi = context_len - num_queries + last_q + 1  # keys past the tile's last query are masked anyway
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(context_len - num_queries + q_off - window + 1, 0)
    kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    if SPLIT:
        # The tile's own key span is cut into num_partitions pieces of whole K/V tiles (not the
        # block table's width): a short context in a wide table still spreads over every
        # partition (a speculative verify step of ~450 keys in a 4,096-key table ran 8 tiles
        # in one program).
        part_size = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_partitions), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + part * part_size
        kv_hi = tl.minimum(kv_hi, kv_lo + part_size)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_base = kv_ptr + kv_head * stride_kvh
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + offs_n
        k_valid = k_pos < kv_hi
        # Gather through the block table key by key: any block size works, 1 included.
        block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        # int64: block * stride_blk overflows int32 in pools of more than 2^31 elements per layer.
        k_off = block.to(tl.int64) * stride_blk + (k_pos % BLOCK_SIZE) * stride_slot
        kv_ptrs = kv_base + k_off[:, None] + offs_d[None, :]
        # (an fp8 pool widens to fp16 here, see above: a no-op for a bf16/fp16 one)
        k = tl.load(kv_ptrs, mask=k_valid[:, None] & d_valid, other=0.0).to(q.dtype)
        v = tl.load(kv_ptrs + stride_kv, mask=k_valid[:, None] & d_valid, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # fp32 [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # tanh(s / c) * c of the scaled score, as exp2 has it: s and c both in log2 units
            s = _tanh(s / cap) * cap
        mask = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(mask, s, float("-inf"))
        m_new, alpha, p = online_softmax(s, m_i)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        # Workspace [max_tokens, heads, max_partitions(, head_dim)] fp32. Every launched partition
        # stores, empty ones as (-inf, 0, 0), so the reduce needs no per-row partition count.
        ws = (token * NUM_HEADS + head) * max_partitions + part
        tl.store(m_ptr + ws, m_i, mask=row_valid)
        tl.store(l_ptr + ws, l_i, mask=row_valid)
        tl.store(acc_ptr + ws[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None] & d_valid)
    else:
        # l == 0 only for a row that sees no key (a dummy sequence of length 0): output 0, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out = tl.where(row_valid[:, None], out, 0.0)
        pad = in_tile & (q_idx >= num_queries) & (seq == num_seqs - 1) & (token < num_tokens)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(row_valid | pad)[:, None] & d_valid)


@triton.jit
def _reduce_partitions_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, query_start_loc_ptr, num_seqs, num_partitions,
                              max_partitions, stride_ot, stride_oh,
                              NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                              PARTS: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # (nanoinfer.backends.cuda.pdl)
        pdl.start()
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = _head_dim_mask(HEAD_DIM, HEAD_DIM_PAD)
    out_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # padding row: no partials were written
        tl.store(out_ptrs, tl.zeros([HEAD_DIM_PAD], out_ptr.dtype.element_ty), mask=d_valid)
        return
    offs_p = tl.arange(0, PARTS)
    p_valid = offs_p < num_partitions
    ws = (token * NUM_HEADS + head) * max_partitions + offs_p
    m = tl.load(m_ptr + ws, mask=p_valid, other=float("-inf"))
    l = tl.load(l_ptr + ws, mask=p_valid, other=0.0)
    acc = tl.load(acc_ptr + ws[:, None] * HEAD_DIM + offs_d[None, :], mask=p_valid[:, None] & d_valid[None, :],
                  other=0.0)
    # Rescale every partition to the global max: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p.
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_valid)


class TritonMetadata(NamedTuple):
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [seqs] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    scale: float
    sliding_window: int  # 0 = none
    softcap: float = 0.0  # Gemma 2's attention soft-cap: scores -> tanh(s / c) * c before the softmax; 0 = none


class TritonPagedAttention:
    """Paged attention on CUDA through Triton; see the module docstring for the kernels.

    The split-K workspaces are allocated once here, for steps of up to `max_split_tokens`
    query rows cut into up to `max_partitions` partitions: one per `partition_size` keys of
    the block table's width, each sequence's own context divided evenly among them (so any
    length is served, and a short context in a wide table is split as finely). Steps with
    more rows, where the query tiles alone fill the GPU, run unsplit: by default past 512
    (row, kv head) programs, about four per SM, beyond which splitting only adds the partial
    writes and the reduce kernel (0.36 ms of a 7.6 ms decode step at batch 256 on an H200).
    A decode step of few (sequence, kv head) programs, up to `few_programs` (batch 1 or 2 of
    8 kv heads), is latency-bound instead: each program walks its keys one tile after another
    while the GPU idles, so past `fine_from` keys of table width its context is cut into
    partitions of `fine_partition` keys (an H100, µs per layer, 8B shape: batch 1, 1,000 keys
    14.3 -> 7.1, 2,000 keys 15.8 -> 8.9; below 256 keys one program is faster, the reduce
    kernel costing more than the split saves; at batch 4, 300 keys, 7.4 -> 8.5: bench/RESULTS.md).

    `deterministic` (issue 65): a query row's bits the same in every step, whatever else the step holds —
    never split (a split combines partial softmaxes in an arithmetic of its own, at cut points that
    follow the table's width), one tile shape for decode and prefill (`tiles`), and no CUDA-core decode
    kernel for an fp8 pool.
    """

    def __init__(self, cfg: ModelConfig, *, max_split_tokens: int | None = None, partition_size: int = 512,
                 max_partitions: int = 32, few_programs: int = 16, fine_from: int = 256, fine_partition: int = 64,
                 device: torch.device | str = "cuda", deterministic: bool = False):
        self.deterministic = deterministic
        if max_split_tokens is None:
            max_split_tokens = max(1, 512 // cfg.num_kv_heads)
        d = cfg.head_dim
        # One register tile holds a whole head, padded to a power of two (tl.arange's rule) and
        # to tl.dot's minimum of 16; past 256 the tiles no longer fit in registers.
        if not 1 <= d <= 256:
            raise ValueError(f"TritonPagedAttention needs head_dim in [1, 256], got {d}")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
        self.num_heads, self.head_dim, self.head_dim_pad = cfg.num_heads, d, max(16, triton.next_power_of_2(d))
        self.group = cfg.num_heads // cfg.num_kv_heads
        # Heads past 128 columns: half as many keys per tile and twice the warps, so the K/V
        # tiles (two pipeline stages) stay in shared memory and the accumulator in registers.
        wide = self.head_dim_pad > 128
        self.block_n, self.num_warps = (32, 8) if wide else (64, 4)
        self.partition_size = triton.cdiv(partition_size, self.block_n) * self.block_n
        # A prefill step's tiles, (query rows, keys, warps, pipeline stages) of each program: over a block table
        # at least `long_from` keys wide, 128 query rows a program, each K/V tile feeding twice the rows (an
        # H100, a 4,096-query chunk over 32k keys: 267 -> 330 TFLOP/s, FlashAttention's 336 through torch's
        # SDPA; over 4k keys 64 rows stay faster, 188 against 173: bench/RESULTS.md, issue 64).
        self.prefill_tiles = (64, self.block_n, self.num_warps, 2)
        self.long_prefill_tiles = (128, self.block_n, 4, 2) if not wide else self.prefill_tiles
        self.long_from = 8192
        self.max_split_tokens, self.max_partitions = max_split_tokens, max_partitions
        self.few_programs, self.fine_from, self.fine_partition = few_programs, fine_from, fine_partition
        ws = (max_split_tokens, cfg.num_heads, max_partitions)
        self.ws_max = torch.empty(ws, dtype=torch.float32, device=device)
        self.ws_sum = torch.empty(ws, dtype=torch.float32, device=device)
        self.ws_acc = torch.empty((*ws, d), dtype=torch.float32, device=device)

    def partitions(self, tokens: int, num_seqs: int, kv_heads: int, max_context: int) -> int:
        """How many partitions the tensor-core kernel cuts each program's keys into (1: the
        unsplit launch) for a step of `tokens` query rows of `num_seqs` sequences over
        `kv_heads` heads, its block table `max_context` keys wide (see the class docstring)."""
        if tokens > self.max_split_tokens or self.deterministic:
            return 1
        partition = self.partition_size
        if tokens <= num_seqs and num_seqs * kv_heads <= self.few_programs and max_context > self.fine_from:
            partition = self.fine_partition  # (a latency-bound decode step)
        return min(self.max_partitions, triton.cdiv(max_context, partition))

    def tiles(self, split: bool, decode: bool, max_context: int) -> tuple[int, int, int, int]:
        """(query rows, keys, warps, pipeline stages) of each program of the tensor-core kernel: a decode-sized
        step (split, or one query per sequence) takes 16 rows, the smallest tensor-core tile, so one decode query
        of a GQA group wastes few rows; a prefill step `prefill_tiles`, or `long_prefill_tiles` over a block
        table at least `long_from` keys wide. Rows are at least a GQA group. `deterministic`: `prefill_tiles` for
        every step (16 rows over 4 warps would sum a row's probabilities across warps, in another order than
        the prefill tiles' sum within one warp)."""
        if self.deterministic:
            return (max(self.prefill_tiles[0], triton.next_power_of_2(self.group)), *self.prefill_tiles[1:])
        tiles = ((16, self.block_n, self.num_warps, 2) if split or decode else
                 self.long_prefill_tiles if max_context >= self.long_from else self.prefill_tiles)
        if not split and decode and self.head_dim_pad <= 128 and not self.deterministic:
            # An unsplit decode step streams each sequence's whole context through one program: longer K/V
            # tiles, three stages deep, keep more loads in flight (batch 256 x ~1k tokens on an H200: 3.83 ->
            # 4.04 TB/s). Wide heads keep their smaller tiles.
            tiles = (16, 2 * self.block_n, self.num_warps, 3)
        return (max(tiles[0], triton.next_power_of_2(self.group)), *tiles[1:])

    def graph_widths(self, block_size: int) -> tuple[int, ...]:
        """The block-table widths (in blocks) where a decode step's attention launch changes
        (`partitions`): a runner captures its decode graphs at each, so that a step of short
        contexts replays a graph whose attention does not split them (`deterministic`: none, it never splits)."""
        if self.deterministic:
            return ()
        return (self.fine_from // block_size, self.partition_size // block_size)

    def prepare(self, batch: Batch, cfg: ModelConfig, window: int | None) -> TritonMetadata:
        # No host work beyond this packing: launch sizes come from shapes inside `attention`.
        return TritonMetadata(batch.block_tables.to(torch.int32), batch.seq_lens.to(torch.int32),
                              batch.query_start_loc.to(torch.int32), cfg.softmax_scale, window or 0,
                              cfg.attn_softcap or 0.0)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # kv_layer: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
        _, _, _, kv_heads, head_dim = kv_layer.shape
        assert kv_layer.is_contiguous() and k.stride(-1) == 1 and v.stride(-1) == 1
        if k.shape[0] == 0:
            return
        _write_kv_kernel[(k.shape[0],)](
            k, v, kv_layer, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_layer.stride(0),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(kv_heads * head_dim),
            FP8=kv_layer.dtype == torch.float8_e4m3fn)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, metadata: TritonMetadata,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        # q, out: [tokens, heads, head_dim]; rows past the last sequence's queries get zeros.
        tokens, heads, d = q.shape
        _, _, block_size, kv_heads, _ = kv_layer.shape
        assert heads == self.num_heads and d == self.head_dim and kv_heads * self.group == heads
        assert q.stride(-1) == 1 and kv_layer.stride(-1) == 1
        out = torch.empty_like(q) if out is None else out
        num_seqs = metadata.seq_lens.shape[0]
        if tokens == 0:
            return out
        if num_seqs == 0:
            return out.zero_()
        # Contexts are bounded by the block tables' width: a shape, so no sync to learn it.
        max_context = metadata.block_tables.shape[1] * block_size
        num_parts = min(self.max_partitions, triton.cdiv(max_context, self.partition_size))
        if (kv_layer.dtype == torch.float8_e4m3fn and tokens <= num_seqs and not metadata.softcap
                and not self.deterministic and triton_decode_cc.takes(self.group, self.head_dim_pad)):
            # A decode step over an fp8 pool with a GQA group of 1 or 2: the CUDA-core kernel,
            # split only while (sequence, KV head) programs are too few to fill the GPU.
            if tokens > self.max_split_tokens or num_seqs * kv_heads >= 256:
                num_parts = 1
            tile = triton_decode_cc.keys_per_tile(self.head_dim_pad)
            part_size = triton.cdiv(triton.cdiv(max_context, num_parts), tile) * tile
            num_parts = triton.cdiv(max_context, part_size)
            triton_decode_cc.decode_attention(
                q, kv_layer, out, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                metadata.scale, metadata.sliding_window, self.head_dim_pad, num_parts, part_size,
                (self.ws_max, self.ws_sum, self.ws_acc), self.max_partitions)
            if num_parts > 1:
                self._reduce(out, metadata, num_parts)
            return out
        num_parts = self.partitions(tokens, num_seqs, kv_heads, max_context)
        split = num_parts > 1
        block_m, block_n, num_warps, stages = self.tiles(split, tokens <= num_seqs, max_context)
        block_q = block_m // self.group
        grid = (triton.cdiv(tokens, block_q) + num_seqs, kv_heads, num_parts if split else 1)
        _paged_attention_kernel[grid](
            q, kv_layer, out, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            self.ws_max, self.ws_sum, self.ws_acc,
            num_seqs, tokens, metadata.scale * _LOG2E, metadata.sliding_window, num_parts, self.max_partitions,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_layer.stride(0), kv_layer.stride(1),
            kv_layer.stride(2), kv_layer.stride(3), metadata.block_tables.stride(0), metadata.softcap * _LOG2E,
            NUM_HEADS=heads, GROUP=self.group, HEAD_DIM=d, HEAD_DIM_PAD=self.head_dim_pad, BLOCK_SIZE=block_size,
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
            SLIDING=metadata.sliding_window > 0, SPLIT=split, FP8_KV=kv_layer.dtype == torch.float8_e4m3fn,
            SOFTCAP=metadata.softcap > 0, num_warps=num_warps, num_stages=stages, **pdl.launch(q.device))
        if split:
            self._reduce(out, metadata, num_parts)
        return out

    def _reduce(self, out: torch.Tensor, metadata: TritonMetadata, num_parts: int) -> None:
        """The split kernels' partitions combined into `out` (padding rows zeroed)."""
        tokens, heads, d = out.shape
        _reduce_partitions_kernel[(tokens, heads)](
            out, self.ws_max, self.ws_sum, self.ws_acc, metadata.query_start_loc, metadata.seq_lens.shape[0],
            num_parts, self.max_partitions, out.stride(0), out.stride(1),
            NUM_HEADS=heads, HEAD_DIM=d, HEAD_DIM_PAD=self.head_dim_pad, PARTS=triton.next_power_of_2(num_parts),
            num_warps=4, **pdl.launch(out.device))
