"""4-bit linear layers on CUDA: the one-row int4 GEMV (two bodies, CUDA cores and tensor cores) and the
several-row int4 GEMM, Triton kernels that read the packed words once.

4-bit weights (nanoinfer.quant.quantized's Int4CudaWeight: AWQ, GPTQ, GGUF's 4-bit groups,
`quantization="int4"`) have kernels of their own, `int4_mm`: one row reads each packed word
once, widens its eight nibbles in registers (to fp32 on CUDA cores, or, for the wide matrices,
to 16-bit floats multiplied on tensor cores) and sums them before their group's scale (the
min times the sum of their inputs), so a batch-1 step reads half a byte per weight; more rows
dequantize each weight tile to the activations' type in registers and multiply it on tensor
cores. From DEQUANT_ROWS rows (a prefill, an eager decode step) the weight is instead written out
in the activations' type by one kernel and multiplied by cuBLAS: the tile kernel's dots take 16 inputs
a plane, and an H100 ran it at ~65 TFLOP/s for 512-token prompts (GGUF's pp512 at 0.41-0.58x llama.cpp's,
bench/RESULTS.md), where the written-out weight costs a few ms a step against a GEMM several times faster
(vLLM's AWQ kernels switch at the same row count).

The one-row kernel shares its epilogues with the 16- and 8-bit one (nanoinfer.backends.cuda.gemv_epilogues).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda.gemv_epilogues import RopeWrite, epilogue, program_rows, quick_bench, rope_write_epilogue
from nanoinfer.backends.cuda.tuned_configs import ShippedChoice
from nanoinfer.quant.quantized import Int4CudaWeight


# One row's 4-bit kernel has two bodies, and the tuning picks between them per shape. On an H100
# the shipped table (tools/sweep_int4_gemv.py: each config timed in CUDA graphs over cold weights)
# takes the tensor cores' for the gate/up projections (8B 28.9 against 33.9 µs, 1B 11.7 against
# 12.0) and the CUDA cores' elsewhere; Triton's 20 ms tuning, alone, had picked the tensor cores'
# for 8B's down, 9% slower there (bench/RESULTS.md, twenty-fourth and twenty-fifth sessions).
@triton.autotune(
    configs=[triton.Config({"TC": False, "BLOCK_N": n, "GROUPS": g, "SPLIT": 1}, num_warps=w, num_stages=3)
             # several rows a thread for the wide matrices (the 8B shapes' and 1B gate/up's winners on an
             # H100), few for the narrow long ones (1B down): bench/RESULTS.md, twenty-third session
             for n, g, w in ((32, 4, 4), (32, 8, 8), (64, 4, 8), (64, 4, 4), (16, 4, 4), (16, 8, 8), (32, 4, 2),
                             (8, 4, 4), (8, 8, 8), (16, 4, 8), (16, 4, 2), (4, 8, 4), (8, 16, 8), (32, 2, 4),
                             # 16 warps, more groups a step: more bytes in flight where the rows give few
                             # programs (8B down: 256 of 8 warps were half a wave; 19.6 µs against 25.2 timed
                             # as a step runs them: twenty-fifth session)
                             (8, 16, 16), (8, 32, 16), (16, 16, 16), (4, 16, 8), (4, 32, 16), (16, 8, 16), (32, 8, 16),
                             (64, 8, 16), (32, 16, 16), (4, 16, 4))]
    + [triton.Config({"TC": True, "BLOCK_N": n, "GROUPS": 1, "SPLIT": s}, num_warps=w, num_stages=3)
       for n, s, w in ((32, 2, 2), (16, 4, 4), (16, 4, 2), (32, 4, 4), (16, 8, 8), (32, 8, 8), (16, 8, 4),
                       (32, 8, 16), (64, 4, 8))],
    key=["N", "K", "GROUP", "HALF"], do_bench=quick_bench, cache_results=True,
    # (AWQ's and GPTQ's fp32 scales take the choice swept for the same shape with fp16 ones: a
    # start without it compiles and times all 33 configs for each projection)
    prune_configs_by={"early_config_prune": ShippedChoice("_int4_gemv_kernel", like=("N", "K", "GROUP"))},
)
@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, N, K, stride_wn, stride_sn, EXP, res_ptr,
                      GROUP: tl.constexpr, HALF: tl.constexpr, TC: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS: tl.constexpr, SPLIT: tl.constexpr, SILU: tl.constexpr = False,
                      RESIDUAL: tl.constexpr = False, kv_ptr=None, slot_ptr=None, cos_ptr=None, sin_ptr=None,
                      stride_kv=0, NUM_HEADS: tl.constexpr = 0, KV_HEADS: tl.constexpr = 0,
                      HEAD_DIM: tl.constexpr = 0):
    # One row, BLOCK_N outputs a program, both bodies computing per (row, group)
    # s sum((OFFSET + q) x) + (m - OFFSET s) sum(x): each nibble becomes OFFSET + q by merging
    # its bits into OFFSET's, and the OFFSETs come off once per group. (HALF only keys the tuning;
    # SILU and RESIDUAL, the epilogues `epilogue` shares with the 16- and 8-bit kernel, do not:
    # a projection takes the config of its plain product; nor does HEAD_DIM, QKV's RoPE and KV write.)
    offs_n, n_mask = program_rows(N, BLOCK_N, SILU, HEAD_DIM)
    if TC:
        out = _int4_gemv_tensor_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn,
                                      GROUP, BLOCK_N, SPLIT)
    else:
        out = _int4_gemv_cuda_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn, EXP,
                                    GROUP, BLOCK_N, GROUPS)
    dtype = out_ptr.dtype.element_ty
    if HEAD_DIM > 0:
        rope_write_epilogue(out.to(dtype), N, out_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, stride_kv, BLOCK_N,
                             NUM_HEADS, KV_HEADS, HEAD_DIM)
        return
    out, offs_n, n_mask = epilogue(out, offs_n, n_mask, N, res_ptr, dtype, BLOCK_N, SILU, RESIDUAL)
    tl.store(out_ptr + offs_n, out.to(dtype), mask=n_mask)


@triton.jit
def _int4_gemv_cuda_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn, EXP,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    # GROUPS whole groups a step, a tile [GROUPS, BLOCK_N, WORDS]. The words are taken a nibble
    # plane at a time (Int4CudaWeight's order: plane k of a group's words is its inputs
    # k WORDS..(k + 1) WORDS, one contiguous load of x), so no tile changes shape; each word sums
    # its products before the group's scale and min meet them.
    # Each nibble becomes the fp32 128 + q in two instructions: moved to bits 16-19 (one shift;
    # none for plane 4) and merged with 128's bits (one LOP3). 128 + q in fp32 keeps 17 bits for
    # q x past the 128 x. The loop is bound by instructions, not bytes (38 a word, bench/sass_count.py),
    # so: EXP is 128.0's bits (0x43000000) passed at run time, because with both masks constants
    # ptxas splits `& mask | bits` into two LOP3s; and the groups lead the tile, so that Triton's
    # layout repeats a thread's words down the rows (its fastest-varying dimensions after the
    # words are the tile's first) and each x load, widening and sum serves several rows.
    WORDS: tl.constexpr = GROUP // 8
    offs_j = tl.arange(0, WORDS)
    acc = tl.zeros([GROUPS, BLOCK_N, WORDS], tl.float32)
    for g0 in range(0, K // GROUP, GROUPS):
        gs = g0 + tl.arange(0, GROUPS)
        g_mask = gs < K // GROUP
        words = tl.load(w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn + (gs * WORDS)[:, None, None]
                        + offs_j[None, None, :], mask=n_mask[None, :, None] & g_mask[:, None, None], other=0)
        dots = tl.zeros([GROUPS, BLOCK_N, WORDS], tl.float32)
        sums = tl.zeros([GROUPS, WORDS], tl.float32)
        for k in tl.static_range(8):
            x = tl.load(x_ptr + (gs * GROUP + k * WORDS)[:, None] + offs_j[None, :], mask=g_mask[:, None],
                        other=0.0).to(tl.float32)
            if k < 4:
                moved = words << (16 - 4 * k)
            else:
                moved = words >> (4 * k - 16)
            dots += ((moved & 0x000F0000) | EXP).to(tl.float32, bitcast=True) * x[:, None, :]
            sums += x
        where = offs_n[None, :] * stride_sn + gs[:, None]
        sg_mask = n_mask[None, :] & g_mask[:, None]
        scale = tl.load(scale_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        acc += scale[:, :, None] * dots + (low - 128.0 * scale)[:, :, None] * sums[:, None, :]
    return tl.sum(tl.sum(acc, 2), 0)


def _nibbles_asm(bits: int) -> str:
    """Inline PTX: two packed words (a, b) in, eight registers of two 16-bit floats out, register k
    (OFFSET + nibble k of a, OFFSET + nibble k of b), each one LOP3 merging the nibbles into
    OFFSET's bits (`bits`, twice: bf16 128.0 is 0x4300, fp16 1024.0 0x6400; in both a nibble lands
    on the mantissa's last four bits, worth 1 apiece). PRMT pairs a's and b's low halves (nibbles
    0-3) and high halves (4-7); a shift by 4, 8 or 12 brings the next nibble of both down: 16
    instructions for 16 weights."""
    merge = f"0x000F000F, {bits:#010x}, 0xea"  # (v & mask) | bits
    lines = ["prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for k in range(8):
        half = "lo" if k < 4 else "hi"
        if k % 4:
            lines.append(f"shr.u32 t, {half}, {4 * (k % 4)};")
        lines.append(f"lop3.b32 ${k}, {'t' if k % 4 else half}, {merge};")
    return "{\n.reg .b32 lo, hi, t;\n" + "\n".join(lines) + "\n}"


_NIBBLES_BF16 = tl.constexpr(_nibbles_asm(0x43004300))
_NIBBLES_FP16 = tl.constexpr(_nibbles_asm(0x64006400))


@triton.jit
def _offset_nibbles(words, dtype: tl.constexpr):
    """[S, R, W] int32 words -> [S, R, 8 W] `dtype` (bf16 or fp16) OFFSET + q in input order: column
    k W + j is word j's nibble k (Int4CudaWeight's order)."""
    if dtype == tl.bfloat16:
        planes = tl.inline_asm_elementwise(_NIBBLES_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                           dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        planes = tl.inline_asm_elementwise(_NIBBLES_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                           dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    p0, p1, p2, p3, p4, p5, p6, p7 = planes
    # Each join adds a last dimension indexed by its operand: t[s, r, j, h, m, l] is plane 4h + 2m + l.
    t = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    # Plane-major: the tensor cores' operand holds these registers as they are (no data moves).
    return tl.reshape(tl.permute(t, (0, 1, 3, 4, 5, 2)), (words.shape[0], words.shape[1], 8 * words.shape[2]))


@triton.jit
def _int4_gemv_tensor_cores(x_ptr, w_ptr, scale_ptr, min_ptr, offs_n, n_mask, K, stride_wn, stride_sn,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    # The weights are the MMA's first operand straight from registers: each chunk of a group's
    # words (at most 16: 128 inputs) becomes OFFSET + q in x's type (`_offset_nibbles`, ~16
    # instructions a word where widening to fp32 took 38), and x, in those columns' input order,
    # the second operand's 8 columns (all equal: column 0 is kept, and the compiler drops the
    # others' arithmetic). The MMA's products are exact ((OFFSET + q) and x each fit x's
    # mantissa) and sum in fp32; the group's scale multiplies a chunk's sum. SPLIT adjacent
    # chunks a step in one batched MMA, summed at the end: more loads in flight a program.
    # A chunk's inputs share its group's min, so the mins' term comes in the same loop: the
    # chunk's sum of x times (m - OFFSET s) (a second pass over the groups cost 8B's down 25.2
    # µs against 23.0 and gate/up 28.7 against 28.1: bench/RESULTS.md, twenty-sixth session).
    WORDS: tl.constexpr = GROUP // 8
    CHUNK: tl.constexpr = WORDS if WORDS < 16 else 16
    dtype = x_ptr.dtype.element_ty
    OFFSET: tl.constexpr = 128.0 if dtype == tl.bfloat16 else 1024.0
    offs_s = tl.arange(0, SPLIT)
    offs_c = tl.arange(0, CHUNK)
    # a chunk's column k CHUNK + c is input k WORDS + c of its group, past its first word's
    offs_in = (tl.arange(0, 8)[:, None] * WORDS + offs_c[None, :]).reshape(8 * CHUNK)
    chunks = K // (8 * CHUNK)
    acc = tl.zeros([SPLIT, BLOCK_N, 8], tl.float32)
    mins = tl.zeros([SPLIT, BLOCK_N], tl.float32)
    for c0 in range(0, chunks, SPLIT):
        cs = c0 + offs_s
        c_mask = cs < chunks
        gs = cs * CHUNK // WORDS
        words = tl.load(w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn + (cs * CHUNK)[:, None, None]
                        + offs_c[None, None, :], mask=n_mask[None, :, None] & c_mask[:, None, None], other=0)
        x = tl.load(x_ptr + (gs * GROUP + cs * CHUNK - gs * WORDS)[:, None] + offs_in[None, :],
                    mask=c_mask[:, None], other=0.0)
        d = tl.dot(_offset_nibbles(words, dtype), tl.broadcast_to(x[:, :, None], (SPLIT, 8 * CHUNK, 8)))
        where = offs_n[None, :] * stride_sn + gs[:, None]
        sg_mask = n_mask[None, :] & c_mask[:, None]
        scale = tl.load(scale_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + where, mask=sg_mask, other=0.0).to(tl.float32)
        acc += scale[:, :, None] * d
        mins += (low - OFFSET * scale) * tl.sum(x.to(tl.float32), 1)[:, None]
    return tl.sum(tl.sum(tl.where(tl.arange(0, 8)[None, None, :] == 0, acc, 0.0), 2), 0) + tl.sum(mins, 0)


@triton.autotune(
    configs=[triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for m, n, k, w, s in ((16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 32, 256, 4, 3), (16, 64, 256, 4, 4),
                                   (32, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 8, 3),
                                   (128, 128, 128, 8, 3), (128, 64, 128, 4, 4), (128, 256, 128, 8, 3))],
    key=["ROWS", "N", "K", "GROUP"], do_bench=quick_bench, cache_results=True,
    prune_configs_by={"early_config_prune": ShippedChoice("_int4_mm_kernel")},
)
@triton.jit(do_not_specialize=["M", "ROWS"])
def _int4_mm_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                    stride_om, ROWS, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # Several rows: each nibble plane of a weight tile dequantized to x's type in registers and
    # multiplied on tensor cores with the inputs it holds (word w's nibble k: input
    # (w // WORDS) GROUP + k WORDS + w % WORDS, Int4CudaWeight's order), eight products a tile
    # (a sum over the inputs in another order). ROWS (M rounded up to a power of 2) keys the
    # tuning: small batches want narrow tiles and many programs, a prefill wide ones.
    WORDS: tl.constexpr = GROUP // 8
    TILE_WORDS: tl.constexpr = BLOCK_K // 8
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_w = k0 // 8 + tl.arange(0, TILE_WORDS)
        w_mask = offs_w < K // 8
        nw_mask = n_mask[:, None] & w_mask[None, :]
        words = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :], mask=nw_mask, other=0)
        where = offs_n[:, None] * stride_sn + (offs_w // WORDS)[None, :]
        scale = tl.load(scale_ptr + where, mask=nw_mask, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + where, mask=nw_mask, other=0.0).to(tl.float32)
        first = (offs_w // WORDS) * GROUP + offs_w % WORDS  # each word's nibble 0 input
        for k in tl.static_range(8):
            q = (((words >> (4 * k)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (first + k * WORDS)[None, :],
                        mask=m_mask[:, None] & w_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans((q * scale + low).to(x.dtype)), acc)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# From this many rows `int4_mm` writes the weight out dequantized and calls cuBLAS (the module's docstring says why).
DEQUANT_ROWS = 256


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An Int4CudaWeight's (packed, scale, low: its min) matrix [N, K] in `dtype`, its inputs in the stored order
    (Int4CudaWeight.cols not applied): each weight q scale + min in fp32, rounded once, as `_int4_mm_kernel`
    rounds it for its tensor cores."""
    n, k = packed.shape[0], packed.shape[1] * 8
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    block_n, block_w = 16, 64
    _int4_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 8, block_w))](
        packed, scale, low, out, n, k, packed.stride(0), scale.stride(0), out.stride(0), GROUP=k // scale.shape[1],
        BLOCK_N=block_n, BLOCK_W=block_w)
    return out


@triton.jit
def _int4_dequantize_kernel(w_ptr, scale_ptr, min_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    # A tile of BLOCK_N rows by BLOCK_W words: word w's nibble k is input (w // WORDS) GROUP + k WORDS + w % WORDS,
    # so each plane k stores runs of WORDS consecutive inputs.
    WORDS: tl.constexpr = GROUP // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (offs_n < N)[:, None] & (offs_w < K // 8)[None, :]
    words = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :], mask=mask, other=0)
    where = offs_n[:, None] * stride_sn + (offs_w // WORDS)[None, :]
    scale = tl.load(scale_ptr + where, mask=mask, other=0.0).to(tl.float32)
    low = tl.load(min_ptr + where, mask=mask, other=0.0).to(tl.float32)
    first = offs_n[:, None].to(tl.int64) * stride_on + ((offs_w // WORDS) * GROUP + offs_w % WORDS)[None, :]
    for k in tl.static_range(8):
        q = (((words >> (4 * k)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        tl.store(out_ptr + first + k * WORDS, (q * scale + low).to(out_ptr.dtype.element_ty), mask=mask)


# 128.0's fp32 bits, a run-time argument of the one-row int4 kernel (why: the kernel's comment)
_BITS_OF_128 = 0x43000000


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
            invariant: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ the Int4CudaWeight (packed, scale, low: its min).T -> [M, N],
    fp32 accumulation; one row in the GEMV kernel, more in the tensor-core one. `invariant`: every row
    count in the tensor-core kernel at one config of rows, K and warps, so that a row's bits do not
    depend on M (the deterministic mode)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    group = k // scale.shape[1]
    m = x.shape[0]
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if invariant:  # (gemv.tiled_matmul's rule: one config but for its output columns; K in 128s, a word's planes)
        from nanoinfer.backends.cuda.gemv import INVARIANT_TILES, invariant_block_n

        bm, bn = INVARIANT_TILES["BLOCK_M"], max(32, invariant_block_n(m))
        _int4_mm_kernel.fn[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, packed, scale, low, out, m, n, k, x.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
            triton.next_power_of_2(m), GROUP=group, BLOCK_N=bn, **{**INVARIANT_TILES, "BLOCK_K": 128})
        return out
    if m == 1:
        _int4_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *int4_gemv_args(x, packed, scale, low, out), GROUP=group, HALF=scale.dtype == torch.float16)
        return out
    if m >= DEQUANT_ROWS and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        # (not in a CUDA graph: the graphs' private pool would keep a whole dequantized weight, which the KV pool's
        # sizing leaves no room for; captured decode steps keep the tile kernel)
        return torch.matmul(x, int4_dequantize(packed, scale, low, x.dtype).T, out=out)
    _int4_mm_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))](
        x, packed, scale, low, out, m, n, k, x.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
        triton.next_power_of_2(m), GROUP=group)
    return out


def int4_gemv(x: torch.Tensor, w: Int4CudaWeight, silu: bool = False, residual: torch.Tensor | None = None,
              rope: RopeWrite | None = None) -> torch.Tensor:
    """One row x [1, K] @ w.T with nanoinfer.backends.cuda.fused_layers' epilogues, one kernel where they took
    one each: `silu`, w is [gate | up] and the output [1, N / 2] is silu(gate) * up;
    `residual` [1, N] is added; `rope`, w is QKV's and q [1, heads, head_dim] comes out RoPE'd,
    k and v stored (as `fused_gemv`'s). The same roundings as `int4_mm`, then
    row_kernels' silu_mul, the add, or nanoinfer.backends.cuda.rope_write's kernel. Needs `int4_kernels_take(w)`."""
    n, k = w.shape
    assert x.shape == (1, k) and x.dtype in (torch.bfloat16, torch.float16) and int4_kernels_take(w)
    assert not silu or (n % 2 == 0 and residual is None and rope is None)
    assert residual is None or (residual.shape == (1, n) and residual.dtype == x.dtype and residual.is_contiguous())
    x = (x if w.cols is None else x.index_select(1, w.cols)).contiguous()
    shape = (1, rope.num_heads, rope.head_dim) if rope is not None else (1, n // 2 if silu else n)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _int4_gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        *int4_gemv_args(x, w.packed, w.scale, w.min, out, residual), GROUP=w.group,
        HALF=w.scale.dtype == torch.float16, SILU=silu, RESIDUAL=residual is not None,
        **({} if rope is None else rope.args(x, n)))
    return out


def int4_gemv_args(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, out: torch.Tensor,
                   residual: torch.Tensor | None = None) -> tuple:
    """`_int4_gemv_kernel`'s positional arguments for one row x @ (packed, scale, low).T into
    `out`: what the launches here pass, and so what tools/sweep_int4_gemv.py times and files its
    choices under (the tuner's key holds every tensor argument's dtype)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    return (x, packed, scale, low, out, n, k, packed.stride(0), scale.stride(0), _BITS_OF_128,
            x if residual is None else residual)


def int4_kernels_take(w: Int4CudaWeight) -> bool:
    """Whether `int4_mm` takes `w`: groups of a power of two from 32 up (a word's eight inputs
    share a group); others (GPTQ's one group per row of 14,336, say) run the
    reference, dequantizing."""
    group = w.group
    return group >= 32 and group & (group - 1) == 0
