"""Prefix caching on a multi-turn chat workload: TTFT and throughput with the cache on and off.

    python bench/prefix.py [--model M | --shape qwen3-0.6b --device cuda] [--conversations 32]
                           [--turns 6] [--system-tokens 1000] [--user-tokens 64] [--reply-tokens 32]

Every conversation starts with the same system prompt; each turn sends the whole history
(system prompt, the earlier user messages and replies) plus a new user message, and waits for
its reply (greedy, `--reply-tokens` long) before the next turn. All conversations run at once
through one AsyncEngine. Token ids are random (fixed seed), so any model or shape works
(`--shape`: random bf16 weights in a real model's shape, bench/shapes.py). The engine runs the
workload twice, prefix caching off then on, same run; TTFT (request submitted -> first token)
is reported for turn 1 and for turns 2..T, and output tok/s for the whole workload.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from runtime.eval.speed import percentile


async def conversation(engine, system, args, rng, vocab, ttfts):
    from nanoinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    history = list(system)
    for turn in range(args.turns):
        history += [rng.randrange(vocab) for _ in range(args.user_tokens)]
        start, first, reply = time.perf_counter(), None, []
        async for out in engine.stream(history, params):
            first = first or time.perf_counter()
            reply += out.outputs[0].token_ids
        ttfts[turn].append(first - start)
        history += reply


async def run(model, engine_args, args):
    from nanoinfer import AsyncEngine
    from runtime.async_engine import engine_config

    vocab = model.config.vocab_size
    system = [random.Random(0).randrange(vocab) for _ in range(args.system_tokens)]
    async with AsyncEngine(model, engine_config(**engine_args)) as engine:
        # warm-up (compiles, graphs): a conversation of other tokens, which no turn below finds cached
        warm = argparse.Namespace(**{**vars(args), "turns": 2, "reply_tokens": 4})
        other = [random.Random(99).randrange(vocab) for _ in range(args.system_tokens)]
        await conversation(engine, other, warm, random.Random(99), vocab, [[], []])
        ttfts = [[] for _ in range(args.turns)]
        start = time.perf_counter()
        await asyncio.gather(*(conversation(engine, system, args, random.Random(1 + c), vocab, ttfts)
                               for c in range(args.conversations)))
        elapsed = time.perf_counter() - start
        stats = engine.stats()
    return ttfts, args.conversations * args.turns * args.reply_tokens / elapsed, stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="random bf16 weights in a real shape (bench/shapes.py)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.shape:
        from bench.shapes import random_model

        model = random_model(args.shape, device=args.device)
    else:
        from nanoinfer.loaders import load_model

        model = load_model(args.model, device=args.device, progress=False)
    longest = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    engine_args = dict(max_model_len=longest + 16, cuda_graph_capture="all")  # (no capture in a timed turn)
    print(f"model {model.path.name}  device {args.device}  {args.conversations} conversations x {args.turns} turns, "
          f"system prompt {args.system_tokens} tokens, user {args.user_tokens}, reply {args.reply_tokens}")
    results = {}
    for caching in (False, True):
        results[caching] = asyncio.run(run(model, {**engine_args, "enable_prefix_caching": caching}, args))
    print(f"{'prefix cache':<14}{'TTFT turn 1 p50/p99 ms':>24}{'TTFT turns 2+ p50/p99 ms':>27}{'output tok/s':>14}"
          f"{'hit rate':>10}")
    for caching, (ttfts, tok_s, stats) in results.items():
        first, later = ttfts[0], [t for turn in ttfts[1:] for t in turn]
        queried = stats.get("prefix_cache_queries", 0)
        hit = stats.get("prefix_cache_hits", 0) / queried if queried else 0.0
        print(f"{'on' if caching else 'off':<14}"
              f"{statistics.median(first) * 1e3:>12.1f} / {percentile(first, 99) * 1e3:<9.1f}"
              f"{statistics.median(later) * 1e3:>14.1f} / {percentile(later, 99) * 1e3:<10.1f}"
              f"{tok_s:>14.1f}{100 * hit:>9.1f}%")
    off, on = (statistics.median([t for turn in results[c][0][1:] for t in turn]) for c in (False, True))
    print(f"TTFT p50 of turns 2+: {off / on:.2f}x lower with the cache")


if __name__ == "__main__":
    main()
