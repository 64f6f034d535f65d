"""cpu_native.c's ARM NEON path (nanoinfer/backends/cpu/cpu_native_arm.h) at each tier, cross-compiled for aarch64
and run under qemu-aarch64 (tests/cpu_native_driver.c calls the kernels on arrays written here):
block_matmul, kquant_matmul and quantize_groups_q8 bit for bit against the x86 build, attention
against it within the x86 path's own tolerance to torch."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.quant import kquants
from nanoinfer.quant.kquants import KQuantWeight, reference_kquant_matmul
from nanoinfer.quant.quantized import BlockWeight, GroupedWeight, reference_block_matmul
from tools.kquant_quantize import quantize as kquant_quantize

CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
DRIVER = Path(__file__).with_name("cpu_native_driver.c")
# -march per tier (qemu's `-cpu max` has them all) and the block_dot_isa() each must report
TIERS = {"neon": ("armv8-a", 4), "neon-dotprod": ("armv8.2-a+dotprod", 5),
         "neon-i8mm": ("armv8.2-a+dotprod+i8mm", 6)}
MATMULS = [(37, 32, 1), (64, 256, 3), (16, 288, 2), (40, 576, 1), (9, 1536, 5), (7, 224, 2)]  # every chunk size
KQUANTS = [(12, 37, 256, 1), (13, 9, 768, 3), (14, 16, 1536, 2),  # type (Q4_K, Q5_K, Q6_K), out, cols, tokens
           (12, 2, 1536, 2), (13, 1, 256, 1), (14, 5, 512, 3)]
# Rows interleaved 16 at a time (cpu_native_vec16.h's NEON vectors): out (a tail of rows % 16 in the file's
# layout), cols, tokens (1: the one-token pass; 2, 3: the few-token passes), symmetric mins (Q4_0's)
INTERLEAVED = [(37, 512, 1, False), (32, 256, 3, True), (21, 768, 2, True)]
KQUANTS_INTERLEAVED = [(12, 37, 512, 1), (13, 16, 256, 3), (14, 21, 512, 2), (14, 32, 256, 1)]
ATTENTION = [(None, 4, 2, 16), (5, 4, 2, 16), (None, 9, 3, 64), (None, 4, 4, 8)]  # window, heads, kv_heads, d
BF16_ULP = 2.0**-7

pytestmark = pytest.mark.skipif(
    not (shutil.which(CROSS) and shutil.which(QEMU)),
    reason=f"the ARM path's test needs {CROSS} and {QEMU} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user; "
           ".ci/run installs them)")


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as numpy holds them (bf16 and fp16 as int16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def block_weight(out: int, cols: int, bits: int) -> BlockWeight:
    g = torch.Generator().manual_seed(out + cols + bits)
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)  # every value, 255 included
    scale = torch.rand(out, cols // 32, generator=g) * 0.1 + 0.01
    mins = -(2 ** (bits - 1)) * scale * (1 + 0.3 * torch.randn(out, cols // 32, generator=g))
    return BlockWeight.from_groups(GroupedWeight(q, scale, mins, bits))


def activations(tokens: int, cols: int) -> torch.Tensor:
    x = randn(tokens, cols, seed=cols, dtype=torch.bfloat16) * 3
    x[0, :32] = 0  # a group of zeros (no scale to divide by)
    x[-1, -32:] *= 100  # and one far larger than the rest
    return x


def interleaved_block_weight(out: int, cols: int, bits: int, symmetric: bool) -> BlockWeight:
    """A block weight's rows interleaved 16 at a time (BlockWeight.interleave), a symmetric format's mins derived."""
    g = torch.Generator().manual_seed(out + cols + bits + symmetric)
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(out, cols // 32, generator=g) * 0.1 + 0.01).half().float()
    mins = -(2 ** (bits - 1)) * scale if symmetric else -scale * torch.rand(out, cols // 32, generator=g)
    return BlockWeight.from_groups(GroupedWeight(q, scale, mins, bits)).interleave(16)


def kquant_weight(qtype: int, out: int, cols: int) -> KQuantWeight:
    w = randn(out, cols, seed=qtype + out) * 0.05
    return KQuantWeight(torch.from_numpy(kquant_quantize(w.numpy(), qtype)), qtype, cols)


def attention_case(window, heads, kv_heads, d):
    """A prefill chunk among decodes, contexts of 1 to 23 keys, blocks out of order (as
    tests/test_cpu_native.py's)."""
    chunks = [SeqChunk([1], 22, [7, 2, 9, 0, 11, 4], True), SeqChunk([5, 6, 7], 2, [3, 10], True),
              SeqChunk([2], 0, [5], True), SeqChunk([8], 9, [1, 6, 8], True)]
    batch = build_batch(chunks, 4)
    kv = randn(2, 12, 4, kv_heads, d, seed=6)
    return batch, kv, randn(batch.num_tokens, heads, d, seed=7), d**-0.5


def write_cases(root: Path) -> None:
    """Every call's inputs under root, and root/cases listing the calls (the driver's format)."""
    lines = ["isa"]
    for rows, k in [(3, 576), (2, 224), (1, 32)]:
        activations(rows, k).view(torch.int16).numpy().tofile(root / f"quantize{k}.x")
        lines.append(f"quantize quantize{k} {rows} {k}")
    for bits in (4, 8):
        for out, cols, tokens in MATMULS:
            name, w = f"matmul{bits}_{out}_{cols}", block_weight(out, cols, bits)
            for array, t in (("x", activations(tokens, cols)), ("q", w.q), ("d", w.scale), ("m", w.min)):
                raw(t).tofile(root / f"{name}.{array}")
            lines.append(f"matmul {name} {tokens} {cols} {out} {bits} 0 1")
        for out, cols, tokens, symmetric in INTERLEAVED:
            name, w = f"matmul{bits}_{out}_{cols}_{tokens}_il", interleaved_block_weight(out, cols, bits, symmetric)
            for array, t in (("x", activations(tokens, cols)), ("q", w.q), ("d", w.scale), ("m", w.min)):
                if t is not None:
                    raw(t).tofile(root / f"{name}.{array}")
            lines.append(f"matmul {name} {tokens} {cols} {out} {bits} 16 {int(w.min is not None)}")
    for qtype, out, cols, tokens in KQUANTS:
        name, w = f"kquant{qtype}_{out}", kquant_weight(qtype, out, cols)
        raw(activations(tokens, cols)).tofile(root / f"{name}.x")
        w.data.numpy().tofile(root / f"{name}.w")
        lines.append(f"kquant {name} {tokens} {cols} {out} {qtype} {w.data.shape[1]} 0")
    for qtype, out, cols, tokens in KQUANTS_INTERLEAVED:
        name, w = f"kquant{qtype}_{out}_{tokens}_il", kquants.interleave(kquant_weight(qtype, out, cols))
        raw(activations(tokens, cols)).tofile(root / f"{name}.x")
        w.data.numpy().tofile(root / f"{name}.w")
        lines.append(f"kquant {name} {tokens} {cols} {out} {qtype} {w.data.shape[1]} 16")
    for i, (window, heads, kv_heads, d) in enumerate(ATTENTION):
        batch, kv, q, scale = attention_case(window, heads, kv_heads, d)
        for array, t in (("q", q), ("kv", kv), ("tables", batch.block_tables), ("lens", batch.seq_lens),
                         ("query_start", batch.query_start_loc)):
            raw(t).tofile(root / f"attention{i}.{array}")
        lines.append(f"attention attention{i} {batch.num_tokens} {batch.num_seqs} {batch.block_tables.shape[1]} 4 "
                     f"{window or 0} {heads} {kv_heads} {d} {float(np.float32(scale)).hex()}")
    (root / "cases").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module", params=list(TIERS))
def arm(request, tmp_path_factory) -> tuple[str, Path]:
    """(tier, the folder holding the tier's outputs): cpu_native.c built for it, run under qemu."""
    march, _ = TIERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    exe = root / "driver"
    # cpu_native.py's flags but for the target and without OpenMP's threads (arithmetic only)
    build = subprocess.run([CROSS, "-O3", f"-march={march}", "-std=c11", "-fopenmp-simd", "-static",
                            str(cpu_native.SOURCE), str(DRIVER), "-o", str(exe), "-lm"],
                           capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr
    write_cases(root)
    run = subprocess.run([QEMU, "-cpu", "max", str(exe), str(root)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr
    return request.param, root


@pytest.fixture(scope="module", params=["native", "avx2"])
def x86(request, tmp_path_factory):
    """The library as built here, and with the VNNI dot products off (x86's two integer paths)."""
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here to build the x86 library the ARM path is compared with")
    extra = () if request.param == "native" else ("-mno-avx512vnni", "-mno-avxvnni")
    lib = cpu_native.load(tmp_path_factory.mktemp(request.param), extra)
    assert lib is not None
    return lib


def read(root: Path, name: str, dtype) -> np.ndarray:
    return np.fromfile(root / name, dtype=dtype)


def test_the_build_targets_the_cpu_by_its_architectures_flag():
    assert cpu_native.native_flag("aarch64") == cpu_native.native_flag("arm64") == "-mcpu=native"  # Linux, macOS
    assert cpu_native.native_flag("x86_64") == cpu_native.native_flag("AMD64") == "-march=native"
    assert cpu_native.block_dot_name(None) == "none"
    # Apple's clang: no OpenMP, so the CPU's flag is kept in the build without threads
    apple = ("-O3", "-mcpu=native", "-fopenmp", "-shared")
    assert cpu_native.build_attempts(apple) == [apple, ("-O3", "-mcpu=native", "-fopenmp-simd", "-shared"),
                                                ("-O3", "-fopenmp", "-shared"), ("-O3", "-fopenmp-simd", "-shared")]


def test_each_tier_reports_itself(arm):
    tier, root = arm
    assert int((root / "isa").read_text()) == TIERS[tier][1]
    assert (root / "name").read_text() == tier


@pytest.mark.parametrize("rows, k", [(3, 576), (2, 224), (1, 32)])
def test_quantize_groups_q8_is_the_x86_builds_bits(arm, x86, rows, k):
    _, root = arm
    x = activations(rows, k)
    xq, xd, xs = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, k // 32), torch.empty(rows, k // 32)
    x86.quantize_groups_q8(x.data_ptr(), rows, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    assert np.array_equal(read(root, f"quantize{k}.xq", np.int8), xq.flatten().numpy())
    assert np.array_equal(read(root, f"quantize{k}.xd", np.uint32), xd.flatten().numpy().view(np.uint32))
    assert np.array_equal(read(root, f"quantize{k}.xs", np.uint32), xs.flatten().numpy().view(np.uint32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out, cols, tokens", MATMULS)
def test_block_matmul_is_the_x86_builds_bits(arm, x86, bits, out, cols, tokens):
    _, root = arm
    w, x = block_weight(out, cols, bits), activations(tokens, cols)
    got = torch.from_numpy(read(root, f"matmul{bits}_{out}_{cols}.y", np.float32).reshape(tokens, out))
    want = reference_block_matmul(x, w)
    torch.testing.assert_close(got, want, rtol=BF16_ULP, atol=1e-5 * float(want.abs().max()))
    if not cpu_native.has_block_matmul(x86):
        pytest.skip("this x86 CPU has no AVX2: the ARM path was held to the torch reference only")
    # the same integer sums, the same fp32 operations in the same order: the same bits
    assert torch.equal(got.view(torch.int32), cpu_native.block_matmul(x, w, x86, torch.float32).view(torch.int32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out, cols, tokens, symmetric", INTERLEAVED)
def test_interleaved_block_matmul_is_the_file_layouts_bits(arm, x86, bits, out, cols, tokens, symmetric):
    """Rows interleaved 16 at a time read by the one kernel of every tier (cpu_native_groups_rows16.h over NEON's
    vectors): the x86 build's bits on the file's layout."""
    if not cpu_native.has_block_matmul(x86):
        pytest.skip("this x86 CPU has no AVX2 to compare with")
    _, root = arm
    w, x = interleaved_block_weight(out, cols, bits, symmetric), activations(tokens, cols)
    got = torch.from_numpy(read(root, f"matmul{bits}_{out}_{cols}_{tokens}_il.y", np.float32).reshape(tokens, out))
    want = cpu_native.block_matmul(x, w.file_layout(), x86, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype, out, cols, tokens", KQUANTS_INTERLEAVED)
def test_interleaved_kquant_matmul_is_the_file_layouts_bits(arm, x86, qtype, out, cols, tokens):
    """K-quant rows interleaved 16 at a time (cpu_native_kquants_rows16.h over NEON's vectors): the torch
    reference's bits."""
    _, root = arm
    w, x = kquant_weight(qtype, out, cols), activations(tokens, cols)
    got = torch.from_numpy(read(root, f"kquant{qtype}_{out}_{tokens}_il.y", np.float32).reshape(tokens, out))
    assert torch.equal(got, reference_kquant_matmul(x, w))


@pytest.mark.parametrize("qtype, out, cols, tokens", KQUANTS)
def test_kquant_matmul_is_the_references_and_the_x86_builds_bits(arm, x86, qtype, out, cols, tokens):
    """Integer sums, then fp32 operations in one order: the same bits on every tier."""
    _, root = arm
    w, x = kquant_weight(qtype, out, cols), activations(tokens, cols)
    got = torch.from_numpy(read(root, f"kquant{qtype}_{out}.y", np.float32).reshape(tokens, out))
    assert torch.equal(got, reference_kquant_matmul(x, w))
    assert torch.equal(got, cpu_native.kquant_matmul(x, w, x86, torch.float32))


@pytest.mark.parametrize("case", range(len(ATTENTION)))
def test_attention_matches_the_x86_build(arm, x86, case):
    """Within the x86 path's tolerance to torch, not bit for bit: the softmax's loops vectorize
    to each ISA's width (the dot products of 8 keys and the weighted sums do match)."""
    _, root = arm
    window, heads, kv_heads, d = ATTENTION[case]
    batch, kv, q, scale = attention_case(window, heads, kv_heads, d)
    want = cpu_native.CpuNative(x86).paged_attention(q, kv, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                                     window, scale)
    got = torch.from_numpy(read(root, f"attention{case}.out", np.float32).reshape(want.shape))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
