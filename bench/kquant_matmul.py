"""One matmul's time per weight form on the CPU: K-quant super-blocks (kquant_matmul) beside groups of 32 (block_matmul).

    OMP_NUM_THREADS=2 python bench/kquant_matmul.py [--out 576] [--cols 1536] [--repeats 7]

The default model's down projection's shape by default; 1 and 8 activation rows; each form
timed interleaved with the others, best of `--repeats` runs of 200 calls, for the native tier
and the AVX2 tier (cpu_native built with its flags). Weights from tools/kquant_quantize.py.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant.kquants import KQuantWeight
from nanoinfer.quant.quantized import BlockWeight
from tests.tiny import grouped
from tools.kquant_quantize import quantize


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=576)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    w = torch.randn(args.out, args.cols) * 0.05
    forms = {"q4 groups (Q4_1)": BlockWeight.from_groups(grouped(w, 4)),
             "8-bit groups (Q5_0/Q8_0)": BlockWeight.from_groups(grouped(w, 8))}
    for name, qtype in (("Q4_K", 12), ("Q5_K", 13), ("Q6_K", 14)):
        forms[name] = KQuantWeight(torch.from_numpy(quantize(w.numpy(), qtype)), qtype, args.cols)
    print(f"matmul {args.out}x{args.cols}, {torch.get_num_threads()} threads, best of {args.repeats} x 200 calls (us)")
    for tier, flags in cpu_native.ISA_FLAGS.items():
        lib = cpu_native.load(extra_flags=flags)
        for tokens in (1, 8):
            x = torch.randn(tokens, args.cols).to(torch.bfloat16)
            best = {name: float("inf") for name in forms}
            for _ in range(args.repeats):
                for name, f in forms.items():
                    call = cpu_native.kquant_matmul if isinstance(f, KQuantWeight) else cpu_native.block_matmul
                    start = time.perf_counter()
                    for _ in range(200):
                        call(x, f, lib)
                    best[name] = min(best[name], (time.perf_counter() - start) / 200 * 1e6)
            print(f"{tier:<7} tokens {tokens}: " + "  ".join(f"{n} {t:.1f}" for n, t in best.items()))


if __name__ == "__main__":
    main()
