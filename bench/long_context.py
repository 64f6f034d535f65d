"""Long prompts on the GPU: time to the first token from 1k to 64k tokens beside transformers' forward, and decode at each.

    python bench/long_context.py [--shapes qwen3-0.6b llama-3.1-8b] [--lengths 1024 8192 32768 65536]
                                 [--chunks 4096] [--decode-tokens 32] [--bandwidth 3350]

Random bf16 weights in real shapes (bench/shapes.py; each shape's context raised to the longest length, which
changes no kernel), one prompt of random ids alone, prefix caching off. Ours: `EngineCore` with
`max_num_batched_tokens` = each of `--chunks` (4,096 is the default engine's: a longer prompt prefills in chunks),
the first token's time from submission to its arrival (best of two); decode tok/s from the same prompt run on for
`--decode-tokens` more, and the bytes a step reads (every weight, and the context's K/V) per second against
`--bandwidth` GB/s. transformers: `from_config` on the device (SDPA, whose CUDA kernel is FlashAttention), one
forward with `logits_to_keep=1` (best of two), in the same process before ours (its memory given back first).
`--profile N`: the kernels of one N-token prompt, ours and transformers', by device time (torch.profiler).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from bench.shapes import HF_CONFIGS, SHAPES, random_model, weight_bytes


def top_kernels(fn, title: str, rows: int = 14) -> None:
    """`fn`'s device time by kernel, the largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"-- {title}: {total / 1e3:.1f} ms of kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"   {e.self_device_time_total / 1e3:9.2f} ms {e.self_device_time_total / total:6.1%} "
              f"x{e.count:<5} {e.key[:110]}")


def time_transformers(name: str, lengths: list[int], max_len: int, profile_len: int = 0) -> dict[int, float]:
    import transformers

    cls, fields = HF_CONFIGS[name]
    config = getattr(transformers, cls)(**fields, max_position_embeddings=max_len)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").eval()
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, 512), device="cuda"), logits_to_keep=1)  # warm-up
        for n in lengths:
            ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
            best = float("inf")
            for _ in range(2):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids, logits_to_keep=1)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            out[n] = best
        if profile_len:
            ids = torch.randint(0, config.vocab_size, (1, profile_len), device="cuda")
            top_kernels(lambda: model(ids, logits_to_keep=1), f"transformers {name}, {profile_len} tokens")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_one(engine, prompt: list[int], max_tokens: int) -> float:
    from nanoinfer.sampling.sampler import SamplingParams

    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def time_ours(model, lengths: list[int], chunk: int, decode_tokens: int,
              profile_len: int = 0) -> dict[int, tuple[float, float]]:
    """Per length: (seconds to the first token, decode tok/s at that context)."""
    from runtime.engine.engine_core import EngineConfig, EngineCore
    from runtime.engine_config import SchedulerConfig

    engine = EngineCore(model, EngineConfig(max_model_len=max(lengths) + decode_tokens + 16, enable_prefix_caching=False,
                                            cuda_graph_capture="all",
                                            scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=16)))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    run_one(engine, torch.randint(0, vocab, (min(chunk, 2048),), generator=gen).tolist(), 4)  # warm-up
    out = {}
    for n in lengths:
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        first = min(run_one(engine, prompt, 1) for _ in range(2))
        whole = run_one(engine, prompt, 1 + decode_tokens)
        out[n] = (first, decode_tokens / max(whole - first, 1e-9))
    if profile_len:
        prompt = torch.randint(0, vocab, (profile_len,), generator=gen).tolist()
        top_kernels(lambda: run_one(engine, prompt, 1), f"ours, chunks of {chunk}, {profile_len} tokens")
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 8192, 32768, 65536])
    p.add_argument("--chunks", nargs="+", type=int, default=[4096])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--bandwidth", type=float, default=3350.0, help="the device's memory bandwidth, GB/s")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="the kernels of an N-token prompt")
    a = p.parse_args()
    max_len = max(a.lengths) + a.decode_tokens + 16
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':<14}{'prompt':>8}{'chunk':>8}{'ours s':>10}{'transformers s':>16}{'ratio':>8}"
          f"{'decode tok/s':>14}{'GB/s':>8}{'of bytes limit':>16}")
    for name in a.shapes:
        base = {} if a.no_baseline else time_transformers(name, a.lengths, max_len, a.profile)
        cfg = dataclasses.replace(SHAPES[name], max_position_embeddings=max(SHAPES[name].max_position_embeddings,
                                                                            max_len))
        model = dataclasses.replace(random_model(name), config=cfg)
        weights = weight_bytes(model)
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        for chunk in a.chunks:
            for n, (first, tps) in time_ours(model, a.lengths, chunk, a.decode_tokens, a.profile).items():
                gbps = (weights + kv_per_token * n) * tps / 1e9
                theirs = base.get(n)
                ratio = f"{theirs / first:>7.2f}x" if theirs else f"{'':>8}"
                print(f"{name:<14}{n:>8}{chunk:>8}{first:>10.3f}{theirs or float('nan'):>16.3f}{ratio}"
                      f"{tps:>14.1f}{gbps:>8.0f}{gbps / a.bandwidth:>15.0%}", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
