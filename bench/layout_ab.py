"""Decode speed of one GGUF file with its weights in the layouts the CPU kernels stream and in the file's, llama.cpp beside.

    python bench/layout_ab.py MODEL.gguf [--new-tokens 64] [--rounds 7] [--threads 2] [--builds NAME=FLAGS ... | --pages]

One process loads the file twice, once as NanoInfer loads it (rows interleaved where the build's one-token kernels
read them so: BlockWeight.interleave, kquants.interleave) and once with the interleaving off, and llama-cpp-python
on the same file; then each generates `--new-tokens` greedy tokens in turn, round after round, and the medians are
printed. On a machine whose speed moves from minute to minute (a shared VM) the three meet the same moments, where
separate runs of bench/cpu_decode.py do not. Decode tok/s leaves the prompt out (a one-token run's time taken off).
`--builds`: instead of the two layouts, builds of cpu_native.c with extra compiler flags (`;`-separated, e.g.
`static=-DKQ16_SCHED=static dyn=-DKQ16_SCHED=dynamic,32`; a first `@REF` builds the sources as git holds them at
REF: `before=@main;-mno-avx512f`), each running the file in the kernels' layout. `--pages`: instead, the weights in
huge pages (as NanoInfer loads them: backends/cpu/huge_pages.py) and in the allocator's 4 KiB pages.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--builds", nargs="*", default=[], help="NAME=FLAGS: cpu_native builds to compare")
    parser.add_argument("--pages", action="store_true", help="compare the weights in huge pages and in 4 KiB pages")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    from bench.kquant_matmul import sources_at
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.backends.cpu import cpu_native
    from nanoinfer.loaders import params

    def load() -> LLM:
        return LLM(args.model, device="cpu", max_model_len=512, progress=False)

    engines = {}
    if args.builds:
        library = cpu_native.library
        for build in args.builds:
            name, _, flags = build.partition("=")
            parts = [f for f in flags.split(";") if f]
            source = cpu_native.SOURCE, cpu_native.HEADERS
            if parts and parts[0].startswith("@"):  # (the C sources as git holds them at that ref)
                folder = sources_at(parts.pop(0)[1:], Path(tempfile.mkdtemp(prefix="layout_ab_")))
                cpu_native.SOURCE = folder / source[0].name
                cpu_native.HEADERS = tuple(folder / h.name for h in source[1] if (folder / h.name).is_file())
            try:
                lib = cpu_native.load(extra_flags=tuple(parts))
            finally:
                cpu_native.SOURCE, cpu_native.HEADERS = source
            cpu_native.library = lambda lib=lib: lib  # (what the loader and the kernels' choice ask for)
            try:
                engines[name] = load()
            finally:
                cpu_native.library = library
    elif args.pages:
        engines["huge pages"] = load()
        moved = params.in_huge_pages
        params.in_huge_pages = lambda t: t
        try:
            engines["4 KiB pages"] = load()
        finally:
            params.in_huge_pages = moved
    else:
        engines["interleaved"] = load()
        layouts = cpu_native.block_interleave_rows, cpu_native.kquant_interleave_rows
        cpu_native.block_interleave_rows = cpu_native.kquant_interleave_rows = lambda lib, kind: 0
        try:
            engines["file layout"] = load()
        finally:
            cpu_native.block_interleave_rows, cpu_native.kquant_interleave_rows = layouts
    llama = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512,
                            verbose=False)
    prompt, n = "The capital of France is", args.new_tokens
    many, one = (SamplingParams(max_tokens=t, temperature=0, ignore_eos=True) for t in (n, 1))

    def ours(llm: LLM) -> float:
        start = time.perf_counter()
        llm.generate([prompt], many, use_tqdm=False)
        took = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        return (n - 1) / (took - (time.perf_counter() - start))

    def theirs() -> float:
        llama.reset()
        llama.eval(llama.tokenize(prompt.encode()))
        start = time.perf_counter()
        for _ in range(n - 1):
            llama.eval([llama.sample(temp=0.0)])
        return (n - 1) / (time.perf_counter() - start)

    runs = {**{name: (lambda e=e: ours(e)) for name, e in engines.items()}, "llama.cpp": theirs}
    for run in runs.values():  # (warm-up)
        run()
    rates = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(run())
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    median = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
    print("median decode tok/s: " + "  ".join(f"{k} {v:.1f} ({v / median['llama.cpp']:.2f}x llama.cpp)"
                                             for k, v in median.items()))


if __name__ == "__main__":
    main()
