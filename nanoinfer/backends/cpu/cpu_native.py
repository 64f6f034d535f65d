"""The CPU's fused layer pieces (cpu_native.c): built once with the system's C compiler, bound with ctypes.

`load()` returns the bound library, or None where no compiler works (the CPU path then stays
in torch ops); `library()` is the process's one copy of it. The build is cached by the source's and the CPU's fingerprint under
nanoinfer's cache directory, so only the first start on a machine compiles (about a second).
Each wrapper here takes and returns tensors; `reference_*` are the torch ops it replaces,
which tests hold it to.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanoinfer.errors import RequestError
from nanoinfer.hub import cache_dir
from nanoinfer.model.layers import rms_norm, swiglu

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
HEADERS = tuple(Path(__file__).with_name(h) for h in (  # SOURCE's includes
    "cpu_native_attention.h", "cpu_native_arm.h", "cpu_native_groups.h", "cpu_native_groups_tiles.h",
    "cpu_native_groups_rows16.h", "cpu_native_vec16.h",
    "cpu_native_kquants.h",
    "cpu_native_kquants_x86.h", "cpu_native_kquants_rows16.h", "cpu_native_kquants_tiles.h",
    "cpu_native_kquants_arm.h"))


def native_flag(machine: str) -> str:
    """The flag that targets this CPU: -mcpu=native on ARM (GCC's and clang's flag there; Apple's
    clang refuses -march=native), -march=native elsewhere."""
    return "-mcpu=native" if machine.lower() in ("arm64", "aarch64") else "-march=native"


# -fopenmp: block_matmul's rows go to threads, and the `omp simd` reductions vectorize
# without -ffast-math. The runtime it links, libgomp.so.1, is the one torch has loaded (the
# loader shares a library by its soname), so both use one thread pool.
FLAGS = ("-O3", native_flag(platform.machine()), "-fopenmp", "-shared", "-fPIC", "-std=c11")
NATIVE_FLAGS = ("-march=native", "-mcpu=native")
# block_dot_isa()'s tiers: the group dot product block_matmul runs (cpu_native.c, cpu_native_arm.h)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "rms_norm_bf16": (_P, _P, _P, _I, _I, _F),
    "add_rms_norm_bf16": (_P, _P, _P, _P, _P, _I, _I, _F),
    "silu_mul_bf16": (_P, _P, _I, _I),
    "rope_write": (_P, _I, _P, _P, _F, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P),
    "paged_attention": (_P, _I, _P, _P, _P, ctypes.c_int64, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _P),
    "block_matmul": (_P, _I, _I, _P, _P, _P, _I, _I, _I, _P, _I, _I),
    "block_interleave_rows": (_I,),
    "quantize_groups_q8": (_P, _I, _I, _P, _P, _P),  # (block_matmul's first step, bound for the tests)
    "kquant_matmul": (_P, _I, _I, _P, _I, _I, _I, _P, _I, _I),
    "kquant_interleave_rows": (_I,),
    "kquant_dequantize_rows": (_P, _I, _I, _P, _I, _P),
    "quantize_q8k": (_P, _I, _I, _P, _P, _P),  # (kquant_matmul's first step, bound for the tests)
    "block_layer_forward": (_P, _P, _P, _P, _P, _P, _P, _P),
    "random_draw": (_P, _P, _P, _P, _I, _I),
    "greedy_rows": (_P, _P, _P, _I, _I),
    "group_rows": (_P, _P, _P, ctypes.c_int64, _I, _I, _P, _I, _P),
}


def _cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (x86's "model name"
    and "flags", ARM Linux's "CPU part" and "Features"; on macOS the chip's name)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keys = ("model name", "flags", "CPU implementer", "CPU part", "Features")
        return "".join(sorted({line for line in lines if line.startswith(keys)}))
    except OSError:
        try:
            chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  check=False).stdout
        except OSError:
            chip = ""
        return chip + platform.processor() + platform.machine()


def build_attempts(flags: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The flag sets `_build` tries in turn: `flags`; without OpenMP's threads (Apple's clang
    has none) but still for this CPU; then without the CPU's flag (compilers that refuse it,
    such as older Apple clangs on arm64 and cross compilers), with and without OpenMP."""
    def serial(tried):
        return tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in tried)

    portable = tuple(f for f in flags if f not in NATIVE_FLAGS)
    return list(dict.fromkeys((flags, serial(flags), portable, serial(portable))))


def _build(target: Path, flags: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: starts may race
        out = Path(tmp) / target.name
        for tried in build_attempts(flags):
            done = subprocess.run([compiler, *tried, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(out, target)


def load(cache: Path | None = None, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The bound library (built on first use), or None if it cannot be built here.
    `extra_flags` go to the compiler (the tests build the AVX2 path with `-mno-avx512vnni`)."""
    flags = FLAGS + extra_flags
    code = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(code + " ".join(flags).encode() + _cpu_fingerprint().encode()).hexdigest()
    target = (cache or cache_dir() / "native") / f"cpu_native-{key[:16]}.so"
    try:
        if not target.is_file():
            _build(target, flags)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("CPU layers stay in torch ops (slower): cannot build %s: %s", SOURCE.name, detail)
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name, None)  # (absent only from sources older than this module: bench/'s builds at a ref)
        if fn is not None:
            fn.argtypes, fn.restype = args, None
    if hasattr(lib, "group_rows"):
        lib.group_rows.restype = ctypes.c_int64
    for name in ("block_dot_isa", "block_matmul", "block_interleave_rows", "kquant_matmul", "kquant_interleave_rows",
                 "kquant_dequantize_rows", "paged_attention", "block_layer_forward"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
    lib.block_dot_name.restype = ctypes.c_char_p
    return lib


# NANOINFER_CPU_ISA picks the tier cpu_native.c is built for: this CPU's best (`native`, the
# default), or `avx2` (AVX-512 and AVX-VNNI off: what an AVX2-only CPU runs, for benches and bug reports).
ISA_VARIABLE = "NANOINFER_CPU_ISA"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni")}


def isa_flags(tier: str) -> tuple[str, ...]:
    """The compiler flags of a NANOINFER_CPU_ISA value."""
    if tier not in ISA_FLAGS:
        raise RequestError(f"{ISA_VARIABLE}={tier!r} is not a CPU tier: expected one of {', '.join(ISA_FLAGS)}")
    if ISA_FLAGS[tier] and platform.machine().lower() not in ("x86_64", "amd64"):
        raise RequestError(f"{ISA_VARIABLE}={tier!r} is an x86 tier; this CPU is {platform.machine()}")
    return ISA_FLAGS[tier]


@functools.cache
def library() -> ctypes.CDLL | None:
    """This process's copy of the library (`load()` once, for NANOINFER_CPU_ISA's tier), its
    kernels logged once."""
    lib = load(extra_flags=isa_flags(os.environ.get(ISA_VARIABLE) or "native"))
    log.info("cpu kernels: %s", describe(lib))
    return lib


def describe(lib: ctypes.CDLL | None) -> str:
    """Which CPU kernels `lib` gives a packed model, in a line (for logs and bug reports)."""
    if lib is None:
        return "torch ops (cpu_native.c did not build)"
    if not has_block_matmul(lib):
        return "fused layers, torch's int4/int8 matmuls (no SIMD group dot product for this CPU)"
    return (f"{block_dot_name(lib)} (q4_0, q4_1, q5_0, q5_1, q8_0 packed in groups of 32; q4_k, q5_k, q6_k in "
            "their super-blocks; int8 activations; fused layers)")


def has_block_matmul(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with a SIMD group dot product (x86 with AVX2, or ARM's NEON;
    elsewhere the CPU keeps torch's int4 kernel)."""
    return lib is not None and lib.block_dot_isa() > 0


def block_interleave_rows(lib: ctypes.CDLL | None, bits: int) -> int:
    """The rows `lib`'s block_matmul reads a BlockWeight of `bits`-bit groups interleaved by (BlockWeight.interleave),
    or 0 where it reads the file's layout only (no library: 0)."""
    return lib.block_interleave_rows(bits) if lib is not None else 0


def kquant_interleave_rows(lib: ctypes.CDLL | None, qtype: int) -> int:
    """The rows `lib`'s kernels read a K-quant of `qtype` interleaved by (kquants.interleave), or 0 where they
    read the file's layout (ARM, plain C, and Q6_K on AVX2 builds)."""
    return lib.kquant_interleave_rows(qtype) if lib is not None else 0


def block_dot_name(lib: ctypes.CDLL | None) -> str:
    """The tier of `lib`'s group dot product, for logs and bug reports: "avx512-vnni",
    "avx-vnni", "avx2", "neon-i8mm", "neon-dotprod", "neon", or "none" (no library either)."""
    return "none" if lib is None else lib.block_dot_name().decode()


def block_matmul(rows: torch.Tensor, w, lib: ctypes.CDLL | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows [tokens, in] bf16 @ w.T -> [tokens, out] in `out_dtype` (bf16, or fp32: a
    tensor-parallel rank's partial sum), the rows rounded to int8 per group of 32. `w` is a
    BlockWeight (its q, scale, min and bits in this library's order; named, not imported:
    nanoinfer.quant.quantized, which defines it, calls this, and holds its torch reference)."""
    lib = lib or library()
    if not has_block_matmul(lib):
        raise RuntimeError("a BlockWeight needs cpu_native's block_matmul, which this machine did not build")
    if rows.dtype != torch.bfloat16 or rows.shape[-1] != w.shape[1]:
        raise TypeError(f"block_matmul takes bf16 rows of {w.shape[1]}, not {rows.dtype} {tuple(rows.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"block_matmul writes bf16 or fp32, not {out_dtype}")
    rows = rows.contiguous()
    (tokens, cols), out_features = rows.shape, w.q.shape[0]
    out = torch.empty(tokens, out_features, dtype=out_dtype)
    if w.interleaved not in (0, block_interleave_rows(lib, w.bits)):
        raise ValueError(f"this build's block_matmul reads {w.bits}-bit groups' rows interleaved by "
                         f"{block_interleave_rows(lib, w.bits)}, not by {w.interleaved}")
    if lib.block_matmul(rows.data_ptr(), tokens, cols, w.q.data_ptr(), w.scale.data_ptr(), _ptr(w.min), w.bits,
                        w.interleaved, out_features, out.data_ptr(), out_dtype == torch.float32,
                        torch.get_num_threads()):
        raise MemoryError(f"block_matmul: no memory to quantize {tokens} x {cols} activations")
    return out


def kquant_matmul(rows: torch.Tensor, w, lib: ctypes.CDLL | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows [tokens, in] bf16 @ w.T -> [tokens, out] in `out_dtype` for a kquants.KQuantWeight,
    the rows rounded to int8 per 256 (llama.cpp's Q8_K); kquants.reference_kquant_matmul is
    its torch reference."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("a KQuantWeight needs cpu_native's kquant_matmul, which this machine did not build")
    if rows.dtype != torch.bfloat16 or rows.shape[-1] != w.cols:
        raise TypeError(f"kquant_matmul takes bf16 rows of {w.cols}, not {rows.dtype} {tuple(rows.shape)}")
    rows = rows.contiguous()
    (tokens, cols), out_features = rows.shape, w.data.shape[0]
    out = torch.empty(tokens, out_features, dtype=out_dtype)
    if w.interleaved not in (0, kquant_interleave_rows(lib, w.qtype)):
        raise ValueError(f"this build's kquant_matmul reads K-quant type {w.qtype}'s rows interleaved by "
                         f"{kquant_interleave_rows(lib, w.qtype)}, not by {w.interleaved}")
    if lib.kquant_matmul(rows.data_ptr(), tokens, cols, w.data.data_ptr(), w.qtype, w.interleaved, out_features,
                         out.data_ptr(), out_dtype == torch.float32, torch.get_num_threads()):
        raise MemoryError(f"kquant_matmul: no memory to quantize {tokens} x {cols} activations")
    return out


def kquant_rows(w, ids: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows `ids` (1-D int64) of a kquants.KQuantWeight in fp32 [len(ids), cols]: an embedding's lookup, the bits of
    kquants.dequantize (its reference) on those rows. Rows interleaved at load go through the reference."""
    lib = lib or library()
    if lib is None or w.interleaved or not w.data.is_contiguous() or not hasattr(lib, "kquant_dequantize_rows"):
        from nanoinfer.quant import kquants

        return kquants.dequantize(w.file_rows(ids))
    ids = ids.to(torch.int64).contiguous()
    bad = ids[(ids < 0) | (ids >= w.data.shape[0])]
    if bad.numel():
        raise IndexError(f"row id {int(bad[0])} out of range for a table of {w.data.shape[0]} rows")
    out = torch.empty(ids.numel(), w.cols)
    if lib.kquant_dequantize_rows(w.data.data_ptr(), w.qtype, w.cols // 256, ids.data_ptr(), ids.numel(), out.data_ptr()):
        raise ValueError(f"kquant_dequantize_rows does not take K-quant type {w.qtype}")
    return out


def takes_group_rows(w) -> bool:
    """Whether `group_rows` reads this grouped.GroupedWeight: bytes, fp32 scales and mins, contiguous, columns in
    order (a GPTQ table's act-order columns go through quantized.embedding, the reference)."""
    return (w.cols is None and w.q.dtype == torch.uint8 and w.scale.dtype == torch.float32
            and w.min.dtype == torch.float32 and all(t.is_contiguous() for t in (w.q, w.scale, w.min)))


def group_rows(w, ids: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
    """Rows `ids` (1-D) of a grouped.GroupedWeight that `takes_group_rows`, in fp32 [len(ids), cols]: an embedding's
    lookup, the bits of quantized.dequantize (its reference) on those rows."""
    if not takes_group_rows(w):
        raise ValueError("group_rows reads uint8 tables with fp32 scales and mins and their columns in order")
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.q.shape[1])
    bad = lib.group_rows(w.q.data_ptr(), w.scale.data_ptr(), w.min.data_ptr(), w.q.shape[0], w.q.shape[1], w.group,
                         ids.data_ptr(), ids.numel(), out.data_ptr())
    if bad >= 0:  # (checked in C: the four torch ops of a mask cost as much as the lookup)
        raise IndexError(f"row id {int(ids[bad])} out of range for a table of {w.q.shape[0]} rows")
    return out


class BlockMat(ctypes.Structure):
    """cpu_native.c's block_mat: a BlockWeight's or KQuantWeight's pointers, and the next
    segment's of a StackedWeight."""


BlockMat._fields_ = [("q", _P), ("d", _P), ("m", _P), ("bits", _I), ("n", _I), ("type", _I), ("interleaved", _I),
                     ("next", ctypes.POINTER(BlockMat))]


class BlockLayer(ctypes.Structure):
    """cpu_native.c's block_layer: a layer's weights, every projection a BlockWeight."""

    _fields_ = [("qkv", BlockMat), ("o", BlockMat), ("gate_up", BlockMat), ("down", BlockMat),
                ("attn_norm", _P), ("mlp_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv_bias", _P)]


class BlockStep(ctypes.Structure):
    """cpu_native.c's block_step: what every layer of a step shares (sizes and the batch's tables)."""

    _fields_ = [(name, _I) for name in ("tokens", "hidden", "heads", "kv_heads", "d", "seqs", "block_size", "window",
                                        "threads")] + [
        ("eps", _F), ("scale", _F), ("slots", _P), ("tables", _P), ("lens", _P), ("query_start", _P),
        ("table_stride", ctypes.c_int64)]


def block_mat(w) -> BlockMat:
    """The struct of a BlockWeight, KQuantWeight or StackedWeight of them (its segments chained:
    ctypes keeps the chained structs alive with the head's `next`)."""
    parts = getattr(w, "parts", (w,))
    mats = [BlockMat(p.data.data_ptr(), None, None, 0, p.data.shape[0], p.qtype, p.interleaved) if hasattr(p, "qtype")
            else BlockMat(p.q.data_ptr(), p.scale.data_ptr(), _ptr(p.min), p.bits, p.q.shape[0], 0, p.interleaved)
            for p in parts]
    for mat, after in zip(mats, mats[1:]):
        mat.next = ctypes.pointer(after)
    mats[0].chain = mats  # (and this keeps them alive with the head, for block_layer's copy of it)
    return mats[0]


def block_layer(lp) -> BlockLayer:
    """The pointers of a LayerParams whose projections are BlockWeights, KQuantWeights or
    StackedWeights of them (their tensors contiguous;
    the caller keeps `lp` alive while the struct is used)."""
    mats = [block_mat(w) for w in (lp.qkv_proj, lp.o_proj, lp.gate_up_proj, lp.down_proj)]
    layer = BlockLayer(*mats, lp.attn_norm.data_ptr(), lp.mlp_norm.data_ptr(), _ptr(lp.q_norm), _ptr(lp.k_norm),
                       _ptr(lp.qkv_bias))
    layer.mats = mats  # (their chained segments, which the copies in `layer` point to)
    return layer


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kv_ptrs(kv_layer: torch.Tensor) -> tuple[int, int]:
    """The K and V halves of a layer's pool [2, ...] (pointer arithmetic: indexing costs a view)."""
    base = kv_layer.data_ptr()
    return base, base + kv_layer.stride(0) * kv_layer.element_size()


def check_attention_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """What `CpuNative.paged_attention` reads through raw pointers: int32, rows contiguous."""
    tables = (block_tables, seq_lens, query_start_loc)
    if any(t.dtype != torch.int32 for t in tables) or block_tables.stride(1) != 1 or not (
            seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        raise TypeError(f"paged_attention takes int32 tables with contiguous rows, not "
                        f"{[(t.dtype, t.stride()) for t in tables]}")


class CpuNative:
    """Tensor-level calls into the library. Inputs must be contiguous; rows are dim 0."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def rms_norm_bf16(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self.lib.rms_norm_bf16(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], x.shape[-1], eps)
        return out

    def add_rms_norm_bf16(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x_out, h = torch.empty_like(x), torch.empty(x.shape, dtype=torch.bfloat16)
        self.lib.add_rms_norm_bf16(x.data_ptr(), y.data_ptr(), w.data_ptr(), x_out.data_ptr(), h.data_ptr(),
                                   x.shape[0], x.shape[-1], eps)
        return x_out, h

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.bfloat16)
        self.lib.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1])
        return out

    def random_draw(self, probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """nanoinfer.sampling.draw.random_draw (its oracle) in one pass per row: the hash in registers, a
        log only for the tokens that could still win."""
        probs, seeds, steps = probs.float().contiguous(), seeds.contiguous(), steps.contiguous()
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        self.lib.random_draw(probs.data_ptr(), seeds.data_ptr(), steps.data_ptr(), out.data_ptr(), probs.shape[0],
                             probs.shape[1])
        return out

    def greedy_and_finite(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """nanoinfer.sampling.sampler.greedy_and_finite (its oracle) on fp32 logits [rows, vocab], one call: the
        three torch reductions and their masks took ~0.2 ms of a decode step at a 49,152-token vocabulary."""
        if logits.dtype != torch.float32 or logits.dim() != 2:
            from nanoinfer.sampling.sampler import greedy_and_finite

            return greedy_and_finite(logits)
        logits = logits.contiguous()
        tokens, finite = torch.empty(logits.shape[0], dtype=torch.int64), torch.empty(logits.shape[0], dtype=torch.bool)
        self.lib.greedy_rows(logits.data_ptr(), tokens.data_ptr(), finite.data_ptr(), logits.shape[0], logits.shape[1])
        return tokens, finite

    def rope_write(self, qkv: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, kv_layer: torch.Tensor, heads: int, kv_heads: int, d: int) -> torch.Tensor:
        tokens = qkv.shape[0]
        q = torch.empty(tokens, heads, d)
        self.lib.rope_write(qkv.data_ptr(), qkv.dtype == torch.bfloat16, _ptr(q_norm), _ptr(k_norm), eps,
                            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tokens, heads, kv_heads, d,
                            *_kv_ptrs(kv_layer), q.data_ptr())
        return q

    def paged_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, window: int | None,
                        scale: float) -> torch.Tensor:
        """Every row of q [tokens, heads, d] attends causally to its sequence's context, as in a
        Batch (block_tables [seqs, width], seq_lens [seqs], query_start_loc [seqs + 1], int32;
        `check_attention_tables` once a step), each row by the same arithmetic whatever shares
        the call; rows past the last sequence's are zero. q: contiguous."""
        heads, d = q.shape[1:]
        seqs = seq_lens.shape[0]
        out = torch.empty_like(q)
        if self.lib.paged_attention(q.data_ptr(), q.shape[0], *_kv_ptrs(kv_layer), block_tables.data_ptr(),
                                    block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), seqs,
                                    kv_layer.shape[2], window or 0, heads, kv_layer.shape[-2], d, scale,
                                    torch.get_num_threads(), out.data_ptr()):
            raise MemoryError(f"paged_attention: no memory for the scratch of {int(seq_lens.sum())} keys")
        return out


    def block_layer_forward(self, layer: BlockLayer, step: BlockStep, cos: torch.Tensor, sin: torch.Tensor,
                            kv_layer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A whole layer (`block_layer`) on x [tokens, hidden] fp32 for a step (`BlockStep`, its
        tables alive): the output rows, the step's keys and values written into `kv_layer`.
        The same functions as the calls one piece at a time, so the same bits."""
        if x.shape[0] != step.tokens or not x.is_contiguous():
            raise ValueError(f"block_layer_forward takes the step's {step.tokens} contiguous rows, not {tuple(x.shape)}")
        out = torch.empty_like(x)
        failed = self.lib.block_layer_forward(ctypes.byref(layer), ctypes.byref(step), cos.data_ptr(), sin.data_ptr(),
                                              *_kv_ptrs(kv_layer), x.data_ptr(), out.data_ptr())
        if failed == -2:
            raise ValueError(f"block_layer_forward: a weight's rows are interleaved as this build ({block_dot_name(self.lib)}) "
                             "does not read them (lay the weights out for the library that runs them)")
        if failed:
            raise MemoryError(f"block_layer_forward: no memory for the scratch of {x.shape[0]} tokens")
        return out


# -- the torch ops each call replaces (the tests' oracle) ----------------------------------

def reference_rms_norm_bf16(x, w, eps):
    return rms_norm(x, w, eps).to(torch.bfloat16)


def reference_add_rms_norm_bf16(x, y, w, eps):
    x_out = x + y.float()
    return x_out, rms_norm(x_out, w, eps).to(torch.bfloat16)


def reference_silu_mul_bf16(gate_up):
    return swiglu(gate_up.float()).to(torch.bfloat16)

