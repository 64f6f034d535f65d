"""GGUF files on the GPU: our `quantization="gguf"` path beside llama.cpp's `llama-bench`, same files, same run.

    python bench/gguf_cuda.py FILE.gguf [FILE.gguf ...] --llama-bench build/bin/llama-bench
                              [--prompt 512] [--gen 128] [--reps 5] [--device cuda]

llama-bench's two tests, as it runs them: pp512 (one 512-token prompt into an empty cache, tokens a second) and
tg128 (128 tokens decoded one at a time from an empty cache), each `--reps` times after a warm-up, every layer on
the GPU (`-ngl 99`), its other settings its defaults. Ours the same through the engine's step loop (CUDA graphs,
async scheduling, greedy, `ignore_eos`): pp = a fresh random prompt a rep (no prefix-cache hit) to its first
token, tg = a one-token prompt and 128 tokens. The files: random weights quantized by llama.cpp's own
`llama-quantize` (tools/make_kquant_bench_gguf.py --quantize-bin), so both engines read the same bytes; the GB/s
column is the file's bytes (every weight once, the embedding's too) times tg tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch


def llama_bench(binary: Path, model: Path, prompt: int, gen: int, reps: int, device: str) -> dict[str, float]:
    """{"pp": tok/s, "tg": tok/s, "type": llama.cpp's name of the file's mix} from llama-bench's JSON."""
    layers = "99" if device == "cuda" else "0"
    out = subprocess.run([str(binary), "-m", str(model), "-p", str(prompt), "-n", str(gen), "-r", str(reps),
                          "-ngl", layers, "-o", "json"], check=True, capture_output=True, text=True).stdout
    runs = json.loads(out)
    result = {"type": runs[0].get("model_type", "?")}
    for run in runs:
        result["pp" if run["n_gen"] == 0 else "tg"] = run["avg_ts"]
    return result


def ours(model_path: Path, prompt: int, gen: int, reps: int, device: str) -> dict[str, float]:
    """{"pp": tok/s, "tg": tok/s} of our engine on `model_path` loaded with quantization="gguf"."""
    from nanoinfer.loaders import load_model
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.engine.engine_core import EngineConfig, EngineCore

    model = load_model(model_path, device=device, quantization="gguf", progress=False)
    engine = EngineCore(model, EngineConfig(block_size=16, max_model_len=max(2048, prompt + gen + 16),
                                            enable_prefix_caching=False, cuda_graph_capture="all",
                                            gpu_memory_utilization=0.5 if device == "cuda" else 0.9))
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(0)

    def run(ids: list[int], tokens: int) -> float:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        sync()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync()
        return time.perf_counter() - start

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def fresh_prompt() -> list[int]:
        return torch.randint(1000, vocab, (prompt,), generator=rng).tolist()

    run(fresh_prompt(), 1)  # (warm-ups: the prefill path, then the decode graphs)
    run([1], gen)
    pp = [prompt / run(fresh_prompt(), 1) for _ in range(reps)]
    tg = [gen / run([1], gen) for _ in range(reps)]  # (the one-token prompt's pass and gen - 1 decodes: gen passes)
    engine.close()
    del engine, model
    return {"pp": statistics.mean(pp), "tg": statistics.mean(tg)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-bench", type=Path, default=None, help="llama.cpp's llama-bench (none: ours only)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}  pp{args.prompt} tg{args.gen}  {args.reps} reps", flush=True)
    rows = []
    for path in args.files:
        size = path.stat().st_size
        theirs = (llama_bench(args.llama_bench, path, args.prompt, args.gen, args.reps, args.device)
                  if args.llama_bench else {"type": "?", "pp": float("nan"), "tg": float("nan")})
        print(f"{path.name}: llama.cpp {theirs}", flush=True)
        mine = ours(path, args.prompt, args.gen, args.reps, args.device)
        print(f"{path.name}: nanoinfer {mine}", flush=True)
        rows.append((path.name, theirs["type"], size, theirs, mine))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'file':<28}{'llama.cpp type':<26}{'MiB':>7}  {'pp llama.cpp':>12}{'ours':>10}{'ratio':>7}"
          f"  {'tg llama.cpp':>12}{'ours':>9}{'ratio':>7}{'GB/s ours':>10}")
    for file, kind, size, theirs, mine in rows:
        print(f"{file:<28}{kind:<26}{size / 2**20:>7.0f}  {theirs['pp']:>12.1f}{mine['pp']:>10.1f}"
              f"{mine['pp'] / theirs['pp']:>7.2f}  {theirs['tg']:>12.1f}{mine['tg']:>9.1f}"
              f"{mine['tg'] / theirs['tg']:>7.2f}{size * mine['tg'] / 1e9:>10.0f}")


if __name__ == "__main__":
    main()
