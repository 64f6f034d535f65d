"""Quantized weight matrices: what each form holds, its matmul, and its dequantized reference.

A projection weight in `Params` is either a dense tensor or one of the frozen dataclasses
here; `linear(x, w, bias)` is the one entry point the model calls, and `dequantize(w)` is
the reference every packed kernel is tested against (tests/test_quantized.py).

- `GroupedWeight` (nanoinfer.quant.grouped) is the loader's exact form of a block-quantized
  matrix (GGUF Q4_0, Q4_1, Q4_K, Q8_0): unsigned integers, a scale and a min per group of 32
  inputs. Rows can be concatenated and permuted (the loader fuses q/k/v and gate/up in it);
  `pack` then turns it into a form a kernel reads. It also serves embedding lookups
  (`embedding`), which need rows, not a matmul.
- `Int4Weight`: torch's packed int4 CPU kernel (`_weight_int4pack_mm_for_cpu`), asymmetric
  groups of 32. 4-bit groups map onto it exactly (the scale and zero round to bf16, the
  kernel's type).
- `SplitInt8Weight`: 8-bit groups (Q8_0) as two int4 halves, u = 16 h + l: the same kernel,
  exact as above, where torch's int8 kernel only takes one scale per row.
- `BlockWeight` (nanoinfer.quant.grouped): 4- and 8-bit groups of 32 in the order of cpu_native.c's
  `block_matmul`, which rounds the activations to int8 per group as llama.cpp does and multiplies in
  integers (torch's int4 kernel multiplies in fp32 and is bound by the cores' FMA rate). The
  CPU's form wherever that library builds with a SIMD dot product; fp16 scales and mins.
- `KQuantWeight` (nanoinfer.quant.kquants): GGUF's Q4_K, Q5_K and Q6_K super-blocks as the file
  stores them, cpu_native.c's `kquant_matmul`; `StackedWeight`: a fused matrix whose parts
  have different forms (Q4_K_M's Q4_K q/k with a Q6_K v), each multiplied in its own.
- `Int8Weight`: per-output-channel int8 (`_weight_int8pack_mm` on the CPU), for formats
  with no exact packed form (K-quants where cpu_native does not build), rounded to the nearest int8, and
  `quantization="int8"` of any checkpoint (CUDA: nanoinfer.backends.cuda.gemv's GEMV at batch 1).
- `Int4CudaWeight`: 4-bit groups of 32-256 inputs packed eight to an int32, a scale and a
  min per group (fp16 where that is exact, else fp32): nanoinfer.backends.cuda.int4_gemv's CUDA kernels read
  it. AWQ and GPTQ checkpoints, GGUF's 4-bit types and `quantization="int4"` load into it.
- `Fp8Weight`: per-output-channel e4m3 (`quantization="fp8"`, FP8 checkpoints): a GEMV at
  batch 1, otherwise activations rounded to e4m3 per token and `torch._scaled_mm`.
- `ExpertStack`: a mixture-of-experts layer's experts' matrices of one kind, stacked [experts, rows, cols] in int8
  or e4m3 with a scale per row (`quantization="int8"` or `"fp8"` of a MoE model): CUDA's expert kernels
  (nanoinfer.backends.cuda.fused_moe, expert_gemv) read the stack; indexed, each expert is an `Int8Weight` or
  `Fp8Weight` (the reference's loop, nanoinfer.model.moe).

The packed kernels take bf16 activations (fp32 ones measured 10-30x slower on the CPU), so
`linear` rounds its input to bf16 and returns the caller's dtype; `lm_head`, the logits'
`linear`, keeps cpu_native's fp32 sums where `linear` rounds a projection's output to bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.nn.functional as F

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant import kquants
from nanoinfer.quant.grouped import BlockWeight, GroupedWeight, block_chunks  # noqa: F401 (their home, re-exported)
from nanoinfer.quant.kquants import KQuantWeight, StackedWeight

@dataclass(frozen=True)
class Int4Weight:
    """torch's packed int4 layout: w = (q - 8) * scale + zero, q in [0, 16), per group of inputs."""

    packed: torch.Tensor  # [out rounded up to 16, in // 2] uint8, `_convert_weight_to_int4pack_for_cpu`'s layout
    scales_and_zeros: torch.Tensor  # [in // group, out rounded up to 16, 2] bf16
    group: int
    rows: int  # out: the kernel packs rows 16 at a time, and the padding rows' outputs are dropped

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.packed.shape[1] * 2

    @staticmethod
    def from_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> "Int4Weight":
        """q [out, in] in [0, 16); scale, zero [out, in // group]."""
        rows, pad = q.shape[0], -q.shape[0] % 16
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q.to(torch.int32), scale, zero))
        packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        scales_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return Int4Weight(packed, scales_and_zeros, q.shape[1] // scale.shape[1], rows)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [tokens, in] bf16 -> [tokens, out] bf16."""
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
        return y if y.shape[1] == self.rows else y[:, :self.rows]


@dataclass(frozen=True)
class SplitInt8Weight:
    """8-bit groups as two int4 matmuls whose outputs add: u = 16 * high + low."""

    high: Int4Weight
    low: Int4Weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.high.shape


@dataclass(frozen=True)
class Int8Weight:
    """w[r, c] = scale[r] * q[r, c], q in [-127, 127]."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out]; bf16 on the CPU (its kernel's type)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @staticmethod
    def quantize(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> "Int8Weight":
        """Round-to-nearest with the row's largest magnitude at 127."""
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Weight(q, scale.to(scale_dtype))


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """e4m3, round to nearest, saturating at +-448 (e4m3 has no infinity: a value past it
    would otherwise come out NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


@dataclass(frozen=True)
class Fp8Weight:
    """w[r, c] = scale[r] * q[r, c], q in float8 e4m3. A matmul of several rows also rounds
    the activations to e4m3, with a scale per token (`fp8_matmul`); a single row (the GEMV)
    keeps them as they are."""

    q: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] fp32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @staticmethod
    def quantize(w: torch.Tensor) -> "Fp8Weight":
        """The row's largest magnitude at e4m3's largest value, round to nearest."""
        w = w.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        return Fp8Weight(to_fp8(w / scale[:, None]), scale)


@dataclass(frozen=True)
class ExpertStack:
    """w[e, r, c] = scale[e, r] * q[e, r, c]: each expert's matrix an Int8Weight's or Fp8Weight's numbers."""

    q: torch.Tensor  # [experts, rows, cols] int8 or float8_e4m3fn
    scale: torch.Tensor  # [experts, rows]; bf16 for int8 on the CPU (its kernel's type), else fp32

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    def __getitem__(self, expert: int) -> "Int8Weight | Fp8Weight":
        return (Fp8Weight if self.q.dtype == FP8 else Int8Weight)(self.q[expert], self.scale[expert])

    @staticmethod
    def quantize(stack: torch.Tensor, form: type, scale_dtype: torch.dtype = torch.float32) -> "ExpertStack":
        """`form` (Int8Weight or Fp8Weight) of each expert of stack [experts, rows, cols], one expert at a time (a
        float copy of one expert's matrix at most, not of the stack)."""
        q = torch.empty(stack.shape, dtype=torch.int8 if form is Int8Weight else FP8, device=stack.device)
        scale = torch.empty(stack.shape[:2], dtype=scale_dtype if form is Int8Weight else torch.float32,
                            device=stack.device)
        for e in range(stack.shape[0]):
            w = Int8Weight.quantize(stack[e], scale_dtype) if form is Int8Weight else Fp8Weight.quantize(stack[e])
            q[e], scale[e] = w.q, w.scale
        return ExpertStack(q, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> (e4m3 [tokens, in], fp32 scale [tokens, 1]), each row's largest
    magnitude at e4m3's largest value. The scale is that magnitude times 1/448 rounded to fp32,
    spelled out: torch's CUDA division by a Python number multiplies by its reciprocal where
    the CPU's divides, and at e4m3's rounding ties the two scales gave different values; so
    both devices and the fused kernel (nanoinfer.backends.cuda.row_kernels) compute the same."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() * (1.0 / FP8_MAX)).clamp(min=1e-12)
    return to_fp8(x.float() / scale), scale


def fp8_matmul(x: torch.Tensor, w: Fp8Weight, quantize: Callable | None = None) -> torch.Tensor:
    """x [tokens, in] @ w.T in x's dtype: activations per token in e4m3 (by `quantize`, CUDA's
    kernel: nanoinfer.backends.cuda.row_kernels; default `quantize_rows_fp8`), then on CUDA one
    `torch._scaled_mm` with row-wise scales (Hopper's fp8 tensor cores). Elsewhere the same
    arithmetic in fp32: the reference."""
    xq, sx = (quantize or quantize_rows_fp8)(x)
    if x.is_cuda:
        return torch._scaled_mm(xq, w.q.t(), scale_a=sx, scale_b=w.scale[None, :], out_dtype=x.dtype)
    return ((xq.float() @ w.q.float().t()) * sx * w.scale[None, :]).to(x.dtype)


@dataclass(frozen=True)
class Int4CudaWeight:
    """w[r, c] = scale[r, c // group] * q[r, c] + min[r, c // group], q in [0, 16), for CUDA.

    A group's `group // 8` words (W) hold its inputs interleaved: nibble k (bits 4k up) of the
    group's word j is its input k W + j. A kernel's nibble plane k of a group's words then
    meets W consecutive inputs, one contiguous load (in input order, plane k would gather
    every eighth input: measured 1.4x slower at batch 1 on an H100, bench/RESULTS.md).
    Scales and mins are fp16 when every one of them is exactly an fp16 (GGUF's Q4_0 and Q4_1),
    else fp32 (Q4_K's products of two scales; AWQ's and GPTQ's min = -scale * zero point)."""

    packed: torch.Tensor  # [out, in // 8] int32
    scale: torch.Tensor  # [out, in // group] fp16 or fp32
    min: torch.Tensor  # [out, in // group], scale's dtype
    cols: torch.Tensor | None = None  # GroupedWeight.cols: the kernels read the inputs in this order

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @staticmethod
    def from_groups(w: GroupedWeight) -> "Int4CudaWeight":
        if w.bits != 4:
            raise ValueError(f"Int4CudaWeight holds 4-bit groups, not {w.bits}-bit")
        out, cols = w.q.shape
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.q.device)
        # [out, groups, 8 (k), W (j)] -> word j's nibble k
        nibbles = w.q.to(torch.int32).reshape(out, cols // w.group, 8, w.group // 8).transpose(2, 3) << shifts
        packed = nibbles.sum(dim=-1, dtype=torch.int64).reshape(out, cols // 8)  # (bit 31 may be set: wrapped)
        packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
        halves = all(torch.equal(t.half().float(), t) for t in (w.scale, w.min))
        dtype = torch.float16 if halves else torch.float32
        return Int4CudaWeight(packed.contiguous(), w.scale.to(dtype).contiguous(), w.min.to(dtype).contiguous(), w.cols)

    def groups(self) -> GroupedWeight:
        """The inverse of `from_groups` (scales and mins in fp32)."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.packed.device)
        out, cols = self.shape
        nibbles = (self.packed.reshape(out, cols // self.group, self.group // 8, 1) >> shifts) & 15  # [.., j, k]
        q = nibbles.transpose(2, 3).reshape(out, cols).to(torch.uint8)
        return GroupedWeight(q, self.scale.float(), self.min.float(), 4, self.cols)


Weight = Union[torch.Tensor, GroupedWeight, BlockWeight, Int4Weight, SplitInt8Weight, Int8Weight, Fp8Weight,
               Int4CudaWeight, KQuantWeight, StackedWeight]


def pack(w: GroupedWeight, blocks: bool = False) -> BlockWeight | Int4Weight | SplitInt8Weight:
    """A CPU kernel's form of `w`: cpu_native's BlockWeight (`blocks`; the same values up to
    fp16 scales) or torch's int4 kernel's (up to bf16 scales)."""
    if blocks:
        return BlockWeight.from_groups(w)
    if w.bits == 4:  # (q - 8) * s + z = s * q + m  =>  z = m + 8 s
        return Int4Weight.from_groups(w.q, w.scale, w.min + 8 * w.scale)
    # s * (16 h + l) + m: the high half has scale 16 s and zero m + 128 s, the low half s and 8 s.
    high, low = w.q >> 4, w.q & 15
    return SplitInt8Weight(Int4Weight.from_groups(high, 16 * w.scale, w.min + 128 * w.scale),
                           Int4Weight.from_groups(low, w.scale, 8 * w.scale))


def take_rows(w: Weight, index: torch.Tensor) -> Weight:
    """The rows at `index` of a row-wise weight (dense, grouped or per-channel int8)."""
    if isinstance(w, torch.Tensor):
        return w[index]
    if isinstance(w, (GroupedWeight, KQuantWeight)):
        return w.rows(index)
    if isinstance(w, (Int8Weight, Fp8Weight)):
        return type(w)(w.q[index], w.scale[index])
    raise TypeError(f"cannot take rows of a packed {type(w).__name__}")


def concat_rows(parts: list[Weight]) -> Weight:
    """Rows stacked (the fused q/k/v and gate/up matrices). Parts of one form stay in it;
    mixed ones (a Q4_K_M file keeps some v and down matrices in Q6_K; GPTQ parts of different
    act-orders) meet in per-row int8."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if (all(isinstance(p, GroupedWeight) for p in parts) and len({p.bits for p in parts}) == 1
            and all(_same_cols(p.cols, parts[0].cols) for p in parts)):
        return GroupedWeight.cat(parts)
    if all(isinstance(p, Fp8Weight) for p in parts):
        return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    if any(isinstance(p, KQuantWeight) for p in parts) and all(
            isinstance(p, KQuantWeight) or isinstance(p, GroupedWeight) and p.cols is None for p in parts):
        return _stack(parts)
    int8 = [p if isinstance(p, Int8Weight) else Int8Weight.quantize(dequantize(p)) for p in parts]
    return Int8Weight(torch.cat([p.q for p in int8]), torch.cat([p.scale for p in int8]))


def _stack(parts: list[Weight]) -> Weight:
    """K-quant and grouped parts: runs of one form merged, the rest a StackedWeight."""
    runs: list[list[Weight]] = []
    for p in parts:
        last = runs[-1][-1] if runs else None
        same = isinstance(p, KQuantWeight) and isinstance(last, KQuantWeight) and p.qtype == last.qtype or (
            isinstance(p, GroupedWeight) and isinstance(last, GroupedWeight) and p.bits == last.bits)
        if same:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [KQuantWeight(torch.cat([kquants.file_layout(p).data for p in run]), run[0].qtype, run[0].cols)
              if isinstance(run[0], KQuantWeight) else GroupedWeight.cat(run) for run in runs]
    return merged[0] if len(merged) == 1 else StackedWeight(tuple(merged))


def _same_cols(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or a is not None and b is not None and torch.equal(a, b)


def dequantize(w: Weight) -> torch.Tensor:
    """The fp32 matrix a quantized weight stands for (the reference of its kernel)."""
    if isinstance(w, torch.Tensor):
        return w.float()
    if isinstance(w, GroupedWeight):
        stored = (w.q.float().unflatten(1, (-1, w.group)) * w.scale[..., None] + w.min[..., None]).flatten(1)
        if w.cols is None:
            return stored
        return torch.empty_like(stored).index_copy_(1, w.cols.to(stored.device), stored)
    if isinstance(w, Int4Weight):
        out, cols = w.shape
        # Unpack by multiplying the identity with unit scales: (q - 8) comes out exactly.
        unit = torch.stack((torch.ones_like(w.scales_and_zeros[..., 0]), torch.zeros_like(w.scales_and_zeros[..., 0])), -1)
        q8 = dataclasses.replace(w, scales_and_zeros=unit).matmul(torch.eye(cols, dtype=torch.bfloat16)).float().t()
        sz = w.scales_and_zeros[:, :out].float().transpose(0, 1).repeat_interleave(w.group, dim=1)  # [out, cols, 2]
        return q8 * sz[..., 0] + sz[..., 1]
    if isinstance(w, SplitInt8Weight):
        return dequantize(w.high) + dequantize(w.low)
    if isinstance(w, (BlockWeight, Int4CudaWeight)):
        return dequantize(w.groups())
    if isinstance(w, (Int8Weight, Fp8Weight)):
        return w.q.float() * w.scale.float()[:, None]
    if isinstance(w, KQuantWeight):
        return kquants.dequantize(w)
    if isinstance(w, StackedWeight):
        return torch.cat([dequantize(p) for p in w.parts])
    raise TypeError(f"not a weight: {type(w).__name__}")


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for any weight form, in x's dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, Fp8Weight):
        y = fp8_matmul(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), w)
        y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
    if isinstance(w, Int4CudaWeight):  # (its reference: the compiled CUDA path runs nanoinfer.backends.cuda.int4_gemv's kernels)
        return F.linear(x, dequantize(w).to(x.dtype), bias)
    if x.is_cuda and isinstance(w, Int8Weight):  # gpt-fast's int8 weight-only matmul (compiled, the cast fuses)
        y = F.linear(x, w.q.to(x.dtype)) * w.scale.to(x.dtype)
        return y if bias is None else y + bias
    # (Each op costs microseconds on the CPU whatever its size: 2-D inputs skip the reshapes.)
    y = packed_matmul((x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).to(torch.bfloat16), w)
    y = y.to(x.dtype) if x.dim() == 2 else y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def packed_matmul(rows: torch.Tensor, w: Weight, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows [tokens, in] bf16 @ w.T -> [tokens, out] in `out_dtype` (bf16 or fp32), for the
    weights torch's packed CPU kernels take (int4 groups, split int8, per-row int8), or
    cpu_native's (BlockWeight, KQuantWeight, a StackedWeight of them). cpu_native's write their
    fp32 sums as they are (a tensor-parallel rank's partial output, the logits); torch's
    kernels write bf16, converted."""
    if isinstance(w, BlockWeight):
        return cpu_native.block_matmul(rows, w, out_dtype=out_dtype)
    if isinstance(w, KQuantWeight):
        return cpu_native.kquant_matmul(rows, w, out_dtype=out_dtype)
    if isinstance(w, StackedWeight):
        return torch.cat([packed_matmul(rows, p, out_dtype) for p in w.parts], dim=1)
    if isinstance(w, Int4Weight):
        y = w.matmul(rows)
    elif isinstance(w, SplitInt8Weight):
        y = w.high.matmul(rows) + w.low.matmul(rows)
    elif isinstance(w, Int8Weight) and w.q.shape[1] % 16 == 0:
        y = torch._weight_int8pack_mm(rows, w.q, w.scale)
    elif isinstance(w, Int8Weight):  # (the kernel reads 16 inputs at a time: other widths crash it)
        y = F.linear(rows, w.q.to(rows.dtype)) * w.scale
    else:
        raise TypeError(f"no matmul for a {type(w).__name__}: pack it first")
    return y.to(out_dtype)


def lm_head(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """The logits x [tokens, hidden] @ w.T in x's dtype: `linear`, except that cpu_native's
    fp32 sums reach x's dtype unrounded. `linear` rounds a projection's output to bf16 (the
    next matmul's input type anyway); logits so rounded sat on a grid, 1/16 nat apart at 8 to
    16, near-ties became exact ties broken by token id, and logprobs lost their resolution
    (issue 59). The rows still go in as bf16, the kernels' input; torch's int4/int8 kernels
    write bf16 only, so their logits keep that grid."""
    if x.is_cuda or x.dim() != 2 or isinstance(w, (torch.Tensor, Fp8Weight, Int4CudaWeight)):
        return linear(x, w)
    return packed_matmul(x.to(torch.bfloat16), w, torch.float32).to(x.dtype)


def reference_block_matmul(rows: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """What cpu_native's `block_matmul` computes, in torch ops, fp32: the rows rounded as it
    rounds them (ggml's Q8_0: per group of 32, 127 at the largest magnitude, round half to
    even), times the dequantized weights."""
    x = rows.float().unflatten(1, (-1, 32))
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0)
    return ((torch.round(x * inv) * (amax / 127)).flatten(1)) @ dequantize(w).t()


def embedding(table: torch.Tensor | GroupedWeight | Int8Weight | KQuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table, dense or quantized row-wise, in `dtype`."""
    if isinstance(table, torch.Tensor):
        return table[ids]
    if isinstance(table, KQuantWeight):  # (its rows in the file's layout, whatever the table's)
        return kquants.dequantize(table.file_rows(ids)).reshape(*ids.shape, -1).to(dtype)
    return dequantize(take_rows(table, ids)).to(dtype)


def map_weight(fn: Callable[[torch.Tensor], torch.Tensor], w: Weight) -> Weight:
    """`fn` applied to each tensor a weight holds (a dense weight is its own tensor)."""
    if isinstance(w, torch.Tensor):
        return fn(w)
    if isinstance(w, StackedWeight):
        return StackedWeight(tuple(map_weight(fn, p) for p in w.parts))
    return dataclasses.replace(w, **{f.name: map_weight(fn, getattr(w, f.name)) for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), (torch.Tensor, *QUANTIZED))})


QUANTIZED = (GroupedWeight, BlockWeight, Int4Weight, SplitInt8Weight, Int8Weight, Fp8Weight, Int4CudaWeight,
             KQuantWeight, StackedWeight, ExpertStack)


def nbytes(w: Weight | None) -> int:
    """Bytes a weight holds (what a batch-1 step reads of it)."""
    if w is None:
        return 0
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if isinstance(w, StackedWeight):
        return sum(nbytes(p) for p in w.parts)
    return sum(nbytes(getattr(w, f.name)) for f in dataclasses.fields(w)
               if isinstance(getattr(w, f.name), (torch.Tensor, *QUANTIZED)))
