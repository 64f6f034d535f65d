"""The CPU's sampled draw, native against torch's, in one process: the engine's draw swapped between runs.

    python -m bench.cpu_draw [--num-seqs 8] [--new-tokens 128] [--rounds 3] [--temperature 0.8]

Loads the default model (packed, so `kernels_for` gives it cpu_native's `random_draw`), then
generates bench/throughput.py's workload (random prompts of 16–64 tokens, seeded requests)
alternating the native draw and `nanoinfer.sampling.draw.random_draw` (the engine's `kernels.draw`
set to None), and prints each run's tok/s and whether the two draws gave every request the
same tokens. Separate processes vary on a 2-core machine by more than the difference, hence
one process (bench/RESULTS.md, twenty-third session).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.throughput import workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from nanoinfer import LLM, SamplingParams
    from runtime.executor.model_runner import ModelRunner

    llm = LLM(None, device="cpu", progress=False)
    runner = next(o for o in gc.get_objects() if isinstance(o, ModelRunner))
    native = runner.kernels.draw
    if native is None:
        raise SystemExit("this model's kernels have no native draw (not a packed model, or no C compiler)")
    prompts, outputs = workload(args.num_seqs, (16, 64), (args.new_tokens, args.new_tokens),
                                llm.model.config.vocab_size)

    def run(draw) -> tuple[float, list]:
        runner.kernels = runner.kernels._replace(draw=draw)
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=i)
                  for i, n in enumerate(outputs)]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        return sum(outputs) / (time.perf_counter() - start), [r.token_ids for r in results]

    run(native)  # (warm-up)
    for _ in range(args.rounds):
        (fast, ours), (slow, theirs) = run(native), run(None)
        print(f"native {fast:7.1f} tok/s   torch {slow:7.1f} tok/s   x{fast / slow:.2f}   "
              f"same tokens: {ours == theirs}")


if __name__ == "__main__":
    main()
