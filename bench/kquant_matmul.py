"""One matmul's time per weight form on the CPU: K-quant super-blocks (kquant_matmul) beside groups of 32 (block_matmul).

    OMP_NUM_THREADS=2 python bench/kquant_matmul.py [--shapes 2048x8192,8192x2048] [--tokens 1]
        [--repeats 7] [--baseline REF [--same-layout]] [--tiers native,avx2] [--copies 1]

For each shape (out x in) and each tier (the native one and AVX2's, cpu_native built with
their flags): 4-bit groups (the Q4_0/Q4_1 kernel; Q4_1's bytes), 8-bit groups, Q4_K, Q5_K and
Q6_K, each in the file's layout and (`rows16`) in the one the tier's one-token kernels read where
it has one, timed interleaved with the others, the fastest call of `--repeats` runs, printed as
microseconds a call and GB/s of weight bytes streamed. `--baseline REF` also builds cpu_native.c
as git holds it at REF (same flags) and times its K-quant kernels in the same run: the before of
a kernel change (`--same-layout`: its one-token kernels too, on today's interleaved rows). Weights from tools/kquant_quantize.py, warm (this machine's L3 holds them), or
with `--copies N` N copies of each called in turn (8 of a 2048x8192 matrix: from DRAM).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant import kquants, quantized
from nanoinfer.quant.kquants import KQuantWeight
from nanoinfer.quant.quantized import BlockWeight
from tests.tiny import grouped
from tools.kquant_quantize import quantize

ROOT = Path(__file__).resolve().parents[1]


def sources_at(ref: str, where: Path) -> Path:
    """cpu_native.c and its headers as of git `ref`, written into a folder of `where` (returned)."""
    folder = where / ref.replace("/", "_")
    folder.mkdir(parents=True, exist_ok=True)
    for path in (cpu_native.SOURCE, *cpu_native.HEADERS):
        shown = subprocess.run(["git", "show", f"{ref}:{path.relative_to(ROOT)}"], cwd=ROOT, capture_output=True)
        if shown.returncode == 0:  # (a header added since `ref` is not included there)
            (folder / path.name).write_bytes(shown.stdout)
    return folder


def baseline_library(ref: str, flags: tuple[str, ...], where: Path) -> ctypes.CDLL:
    """cpu_native.c and its headers as of git `ref`, built with `flags` (cpu_native's own build, by hand)."""
    folder = sources_at(ref, where)
    out = folder / f"old{abs(hash(flags))}.so"
    subprocess.run(["cc", *cpu_native.FLAGS, *flags, str(folder / cpu_native.SOURCE.name), "-o", str(out), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(out))
    for name in ("kquant_matmul", "block_matmul"):
        getattr(lib, name).argtypes = cpu_native.SIGNATURES[name]
        getattr(lib, name).restype = ctypes.c_int
    lib.block_dot_isa.restype = ctypes.c_int
    return lib


def time_call(call, calls: int) -> float:
    """The fastest of `calls` calls: this VM's neighbours slow it in bursts, which a mean would take in."""
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x8192,8192x2048", help="out x in, comma-separated")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline", help="a git ref whose K-quant kernels to time beside these")
    parser.add_argument("--tiers", default=",".join(cpu_native.ISA_FLAGS), help="of cpu_native.ISA_FLAGS")
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight called in turn (8: from DRAM)")
    parser.add_argument("--same-layout", action="store_true",
                        help="the baseline's one-token kernels on today's interleaved rows too (a kernel change, not a layout's)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kquant_bench_"))
    libs = {}
    for tier in args.tiers.split(","):
        flags = cpu_native.ISA_FLAGS[tier]
        libs[tier] = cpu_native.load(extra_flags=flags)
        if args.baseline:
            libs[f"{tier} @{args.baseline}"] = baseline_library(args.baseline, flags, scratch)
    print(f"{torch.get_num_threads()} threads, {args.tokens} token(s), best of {args.repeats} runs; GB/s of weights")
    for shape in args.shapes.split(","):
        out, cols = map(int, shape.split("x"))
        w = torch.randn(out, cols, generator=torch.Generator().manual_seed(0)) * 0.05
        forms = {"4-bit groups (Q4_0/Q4_1)": BlockWeight.from_groups(grouped(w, 4)),
                 "8-bit groups (Q8_0)": BlockWeight.from_groups(grouped(w, 8))}
        for name, qtype in (("Q4_K", 12), ("Q5_K", 13), ("Q6_K", 14)):
            forms[name] = KQuantWeight(torch.from_numpy(quantize(w.numpy(), qtype)), qtype, cols)
        laid = {}  # (tier, form): the copies it is called on, in each layout the tier reads
        for tier, lib in libs.items():
            for name, f in forms.items():
                if isinstance(f, BlockWeight):
                    group = 0 if "@" in tier and not args.same_layout else cpu_native.block_interleave_rows(lib, f.bits)
                    rows16 = f.interleave(group) if group else None
                else:
                    group = cpu_native.kquant_interleave_rows(lib, f.qtype)
                    rows16 = kquants.interleave(f, group) if group and ("@" not in tier or args.same_layout) else None
                laid[tier, name] = [_copy(f) for _ in range(args.copies)]
                if rows16 is not None:
                    laid[tier, name + " rows16"] = [_copy(rows16) for _ in range(args.copies)]
        x = torch.randn(args.tokens, cols).to(torch.bfloat16)
        calls = max(3, int(2e8 / (out * cols)))  # ~0.1 s a run
        best = {}
        for _ in range(args.repeats):  # tiers and forms interleaved: another load on the machine hits them alike
            for (tier, name), copies in laid.items():
                lib = libs[tier]
                if "@" in tier and not isinstance(copies[0], KQuantWeight) and not args.same_layout:
                    continue  # (the baseline's group kernel is today's: timed once, above)
                matmul = cpu_native.kquant_matmul if isinstance(copies[0], KQuantWeight) else cpu_native.block_matmul
                turn = iter(range(1 << 62))
                call = lambda: matmul(x, copies[next(turn) % len(copies)], lib)  # noqa: E731
                best[tier, name] = min(best.get((tier, name), float("inf")), time_call(call, calls))
        for tier in libs:
            print(f"{shape:>10} {tier:<16} " + "  ".join(
                f"{n} {t * 1e6:.0f} us {quantized.nbytes(laid[at, n][0]) / t / 1e9:.1f} GB/s"
                for (at, n), t in best.items() if at == tier))


def _copy(w):
    """A copy of a weight in its own memory."""
    return quantized.map_weight(torch.clone, w)


if __name__ == "__main__":
    main()
