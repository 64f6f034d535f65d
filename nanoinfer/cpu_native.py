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

from nanoinfer.layers import rms_norm, swiglu
from nanoinfer.quantized import BlockWeight, dequantize

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
# -fopenmp: block_matmul's rows go to threads, and the `omp simd` reductions vectorize
# without -ffast-math. The runtime it links, libgomp.so.1, is the one torch has loaded (the
# loader shares a library by its soname), so both use one thread pool.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "rms_norm_bf16": (_P, _P, _P, _I, _I, _F),
    "add_rms_norm_bf16": (_P, _P, _P, _P, _P, _I, _I, _F),
    "silu_mul_bf16": (_P, _P, _I, _I),
    "rope_write": (_P, _I, _P, _P, _F, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P),
    "decode_attention": (_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P, _P),
    "decode_attention_paged": (_P, _P, _P, _P, ctypes.c_int64, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P),
    "block_matmul": (_P, _I, _I, _P, _P, _P, _I, _I, _P, _I),
}


def _cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _build(target: Path, flags: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: starts may race
        out = Path(tmp) / target.name
        portable = tuple(f for f in flags if f != "-march=native")  # for compilers that refuse it (some arm64 clangs)
        serial = tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in portable)  # and those without OpenMP
        for tried in (flags, portable, serial):
            done = subprocess.run([compiler, *tried, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(out, target)


def load(cache: Path | None = None, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The bound library (built on first use), or None if it cannot be built here.
    `extra_flags` go to the compiler (the tests build the AVX2 path with `-mno-avx512vnni`)."""
    from nanoinfer.loaders.hub import cache_dir

    flags = FLAGS + extra_flags
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + _cpu_fingerprint().encode()).hexdigest()
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
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.block_dot_isa.restype = lib.block_matmul.restype = ctypes.c_int
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """This process's copy of the library (`load()` once)."""
    return load()


def has_block_matmul(lib: ctypes.CDLL | None) -> bool:
    """Whether `lib` was built with a SIMD group dot product (x86 with AVX2; elsewhere the
    CPU keeps torch's int4 kernel)."""
    return lib is not None and lib.block_dot_isa() > 0


def block_matmul(rows: torch.Tensor, w: BlockWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """rows [tokens, in] bf16 @ w.T -> [tokens, out] bf16, the rows rounded to int8 per group
    of 32 (`reference_block_matmul` is the same in torch ops)."""
    lib = lib or library()
    if not has_block_matmul(lib):
        raise RuntimeError("a BlockWeight needs cpu_native's block_matmul, which this machine did not build")
    if rows.dtype != torch.bfloat16 or rows.shape[-1] != w.shape[1]:
        raise TypeError(f"block_matmul takes bf16 rows of {w.shape[1]}, not {rows.dtype} {tuple(rows.shape)}")
    rows = rows.contiguous()
    (tokens, cols), out_features = rows.shape, w.q.shape[0]
    out = torch.empty(tokens, out_features, dtype=torch.bfloat16)
    if lib.block_matmul(rows.data_ptr(), tokens, cols, w.q.data_ptr(), w.scale.data_ptr(), w.min.data_ptr(), w.bits,
                        out_features, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"block_matmul: no memory to quantize {tokens} x {cols} activations")
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _kv_ptrs(kv_layer: torch.Tensor) -> tuple[int, int]:
    """The K and V halves of a layer's pool [2, ...] (pointer arithmetic: indexing costs a view)."""
    base = kv_layer.data_ptr()
    return base, base + kv_layer.stride(0) * kv_layer.element_size()


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

    def rope_write(self, qkv: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, kv_layer: torch.Tensor, heads: int, kv_heads: int, d: int) -> torch.Tensor:
        tokens = qkv.shape[0]
        q = torch.empty(tokens, heads, d)
        self.lib.rope_write(qkv.data_ptr(), qkv.dtype == torch.bfloat16, _ptr(q_norm), _ptr(k_norm), eps,
                            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tokens, heads, kv_heads, d,
                            *_kv_ptrs(kv_layer), q.data_ptr())
        return q

    def decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                         rows: torch.Tensor | None, scale: float, scores: torch.Tensor, out: torch.Tensor) -> None:
        """Into `out`'s rows `rows` (None: all); `scores`: fp32 scratch of heads // kv_heads * keys."""
        heads, d = q.shape[1:]
        n, keys = slots.shape
        assert scores.numel() >= heads // kv_layer.shape[-2] * keys
        self.lib.decode_attention(q.data_ptr(), *_kv_ptrs(kv_layer), slots.data_ptr(),
                                  counts.data_ptr(), _ptr(rows), n, keys, heads, kv_layer.shape[-2], d, scale,
                                  scores.data_ptr(), out.data_ptr())

    def decode_attention_paged(self, q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, window: int | None, scale: float, slot_scratch: torch.Tensor,
                               scores: torch.Tensor) -> torch.Tensor:
        """Every row of q a decode: row i is sequence i's newest token (block_tables [n, width]
        and seq_lens [n] int32, as in a Batch). Scratch: int64 and fp32 for the longest context
        (fp32 times heads // kv_heads)."""
        heads, d = q.shape[1:]
        n, width = block_tables.shape
        block_size = kv_layer.shape[2]
        assert slot_scratch.numel() >= width * block_size and scores.numel() >= heads // kv_layer.shape[-2] * width * block_size
        out = torch.empty_like(q)
        assert block_tables.stride(1) == 1 and seq_lens.stride(0) == 1  # (rows of a wider table are fine)
        self.lib.decode_attention_paged(q.data_ptr(), *_kv_ptrs(kv_layer), block_tables.data_ptr(),
                                        block_tables.stride(0), seq_lens.data_ptr(), n, block_size, window or 0, heads,
                                        kv_layer.shape[-2], d, scale, slot_scratch.data_ptr(), scores.data_ptr(),
                                        out.data_ptr())
        return out


# -- the torch ops each call replaces (the tests' oracle) ----------------------------------

def reference_rms_norm_bf16(x, w, eps):
    return rms_norm(x, w, eps).to(torch.bfloat16)


def reference_add_rms_norm_bf16(x, y, w, eps):
    x_out = x + y.float()
    return x_out, rms_norm(x_out, w, eps).to(torch.bfloat16)


def reference_silu_mul_bf16(gate_up):
    return swiglu(gate_up.float()).to(torch.bfloat16)


def reference_block_matmul(rows, w):
    """fp32: the rows rounded as block_matmul rounds them (ggml's Q8_0: per group of 32,
    127 at the largest magnitude, round half to even), times the dequantized weights."""
    x = rows.float().unflatten(1, (-1, 32))
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0)
    return ((torch.round(x * inv) * (amax / 127)).flatten(1)) @ dequantize(w).t()
