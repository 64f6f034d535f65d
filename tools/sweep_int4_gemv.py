"""Time the one-row int4 GEMV's configs as a decode step runs them and ship the winners in this GPU's table.

    python tools/sweep_int4_gemv.py --shape qwen3-0.6b llama-3.2-1b llama-3.1-8b [--group 128] [--out nanoinfer/backends/cuda/tuned]

Triton's tuner times each config for 20 ms, one call at a time (nanoinfer.backends.cuda.gemv_epilogues' `quick_bench`):
for the 4-bit kernel its picks differed between leases of one H100 model by up to 10% of a
projection's time, and each start with no table re-tunes (bench/RESULTS.md, twenty-fourth and
twenty-fifth sessions). Here every config of `_int4_gemv_kernel` runs each projection of each
shape (random groups, fp16 scales as `quantization="int4"` makes them) inside a CUDA graph
that cycles over 4 copies of the weight, so each call reads its weight from memory as a layer's
does, not from L2. The fastest config per shape becomes the shipped choice for the key the
Autotuner files that call under; `tools/dump_tuned_configs.py` writes the other kernels' choices
(and leaves this kernel's alone).
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
COPIES = 4  # weights cycled in a graph: more bytes than an H100's 50 MB of L2 for all but the smallest


def projections(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of one layer's projections."""
    h = cfg.hidden_size
    return {"qkv": (cfg.q_size + 2 * cfg.kv_size, h), "o": (h, cfg.q_size), "gate_up": (2 * cfg.intermediate_size, h),
            "down": (h, cfg.intermediate_size)}


def main() -> None:
    from nanoinfer.backends.cuda.tuned_configs import TUNED_DIR  # (the tables the package ships)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", required=True, help="bench/shapes.py names")
    parser.add_argument("--group", type=int, default=128, help="inputs a scale and min cover")
    parser.add_argument("--out", type=Path, default=TUNED_DIR, help="the tables' directory")
    args = parser.parse_args()

    import torch
    import triton
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    from bench.shapes import SHAPES
    from nanoinfer.backends.cuda import int4_gemv
    from nanoinfer.quant import quantized
    from nanoinfer.backends.cuda.tuned_configs import (ConfigChoice, KernelTable, autotune_key, merge, read_table, table_path,
                                         write_table)

    unknown = [s for s in args.shape if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown --shape {', '.join(unknown)}: expected some of {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed")
    tuner, g = int4_gemv._int4_gemv_kernel, args.group
    torch.manual_seed(0)

    def weight(n: int, k: int) -> quantized.Int4CudaWeight:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
        scale = ((torch.rand(n, k // g, device="cuda") * 0.02 + 1e-3) / k**0.5).half().float()
        low = (-scale * torch.randint(0, 16, scale.shape, device="cuda")).half().float()
        return quantized.Int4CudaWeight.from_groups(quantized.GroupedWeight(q, scale, low, 4))

    def graph_us(calls) -> float:
        for call in calls:  # (compiles each config once, outside the capture)
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                for call in calls:
                    call()
        return triton.testing.do_bench(graph.replay, warmup=5, rep=60) / (5 * len(calls)) * 1e3

    choices = {}
    for shape in args.shape:
        for name, (n, k) in projections(SHAPES[shape]).items():
            ws = [weight(n, k) for _ in range(COPIES)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
            flags = dict(GROUP=g, HALF=ws[0].scale.dtype == torch.float16)
            w = ws[0]
            # (the key the Autotuner files this call under, as int4_mm launches it)
            key = autotune_key(tuner.keys, dict(zip(tuner.arg_names, int4_gemv.int4_gemv_args(x, w.packed, w.scale, w.min,
                                                                                          out))), flags)
            if key in choices:  # (a projection of the same size in an earlier shape)
                continue
            timed = []
            for c in tuner.configs:
                calls = [lambda w=w, c=c: tuner.fn[(triton.cdiv(n, c.kwargs["BLOCK_N"]),)](
                    *int4_gemv.int4_gemv_args(x, w.packed, w.scale, w.min, out), **flags, num_warps=c.num_warps,
                    num_stages=c.num_stages, **c.kwargs) for w in ws]
                try:
                    timed.append((graph_us(calls), ConfigChoice.of(c)))
                except (OutOfResources, PTXASError, CompileTimeAssertionFailure) as e:  # (as Triton's tuner)
                    print(f"{shape} {name}: {dict(c.kwargs)} w{c.num_warps} does not run here: {e}", flush=True)
            timed.sort(key=lambda t: t[0])
            choices[key] = timed[0][1]
            best = ", ".join(f"{us:.2f} µs {dict(c.kwargs)} w{c.num_warps}" for us, c in timed[:3])
            print(f"{shape} {name} {n}x{k}: {best}; slowest {timed[-1][0]:.2f} µs", flush=True)

    device = torch.cuda.get_device_name()
    path = table_path(device, args.out)
    _, table = read_table(path)
    write_table(path, device, merge(table, {"_int4_gemv_kernel": KernelTable(tuple(tuner.keys), choices)}),
                triton.__version__)
    print(f"wrote {len(choices)} choices of _int4_gemv_kernel into {path}")


if __name__ == "__main__":
    main()
