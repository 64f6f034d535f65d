"""Prompt processing on the CPU beside llama.cpp's: the time to take an N-token prompt (llama-bench's ppN).

    python bench/cpu_prefill.py --model FILE.gguf [--tokens 512] [--threads 2] [--repeats 3] [--which both]

Ours is `LLM.generate` of a prompt of random ids with `max_tokens=1` (its prefill and one sampled token);
llama.cpp's is llama-cpp-python's `eval` of the same number of tokens in one batch (`n_batch` = the prompt). Each
side takes a fresh random prompt a run (no prefix cache hit), after one warm-up run; the best run is printed
(this VM's neighbours slow single runs in bursts). Run the two sides in turns for a comparison (bench/RESULTS.md,
issue 62).
"""

from __future__ import annotations

import argparse
import random
import time


def best_of(runs: int, once) -> float:
    once()  # warm-up
    return min(_timed(once) for _ in range(runs))


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--which", choices=("both", "ours", "llama"), default="both")
    a = p.parse_args()
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(a.tokens)]

    if a.which in ("both", "ours"):
        import torch

        from nanoinfer.sampling.sampler import SamplingParams
        from runtime.llm import LLM

        torch.set_num_threads(a.threads)
        llm = LLM(model=a.model, device="cpu", max_model_len=max(2048, a.tokens + 16))
        params = SamplingParams(temperature=0, max_tokens=1)
        seconds = best_of(a.repeats, lambda: llm.generate([prompt()], params, use_tqdm=False))
        print(f"nanoinfer pp{a.tokens}: {seconds * 1e3:.0f} ms, {a.tokens / seconds:.1f} tok/s", flush=True)
        del llm
    if a.which in ("both", "llama"):
        from llama_cpp import Llama

        llama = Llama(model_path=a.model, n_ctx=max(2048, a.tokens + 16), n_threads=a.threads,
                      n_threads_batch=a.threads, n_batch=a.tokens, n_ubatch=a.tokens, verbose=False)

        def once() -> None:
            llama.reset()
            llama.eval(prompt())

        seconds = best_of(a.repeats, once)
        print(f"llama.cpp pp{a.tokens}: {seconds * 1e3:.0f} ms, {a.tokens / seconds:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
