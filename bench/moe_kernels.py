"""The expert kernels' time per call on CUDA, by kernel and tile choice: what `fused_moe.tiles`,
`fused_moe.few_pairs` and `expert_gemv`'s tiles should pick.

    python bench/moe_kernels.py [--shapes qwen3-30b-a3b mixtral-8x7b] [--tokens 1 4 16 64 256] [--gemv-tokens 1 2 4 8]

For each shape (one layer's experts, random bf16 weights) and token count, each (BLOCK_N, num_warps, num_stages)
candidate times `grouped_experts` (align, gate/up, SiLU · up, down, the k products' sum) replayed in a CUDA graph,
median of 5 runs of 50 replays, and its GB/s over the distinct experts' bytes the step's routing reads (every
chosen expert's gate/up and down matrices once): the bytes limit of a decode's MoE layer. The first candidate is
the tree's own choice (`fused_moe.tiles`). For the `--gemv-tokens` counts, the decode GEMVs (`expert_gemv`) beside
it: both kernels together with their default tiles, then each kernel alone by (BLOCK_N, BLOCK_K, num_warps,
num_stages) candidate, its GB/s over its own matrices' distinct bytes.
"""

from __future__ import annotations

import argparse
import statistics

import torch

SHAPES = {  # experts, k, hidden, expert inner width
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
CANDIDATES = [(16, 4, 4), (16, 2, 4), (32, 4, 4), (32, 4, 5), (64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 4)]
GEMV_CANDIDATES = [(4, 512, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (32, 256, 8, 3),
                   (4, 1024, 4, 3), (8, 256, 4, 5), (2, 1024, 4, 4)]


def time_graph(fn, reps: int = 50, runs: int = 5) -> float:
    """Median µs of one call of `fn` replayed in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # (Triton compiles, the allocator settles)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def gemv_rows(name, tokens, x, gate_up, down, weights, chosen, limit, expert_gemv, fused_moe) -> None:
    """The decode GEMVs beside the grouped kernel at one token count, then each GEMV by tile candidate."""
    pick = "gemv" if fused_moe.few_pairs(*chosen.shape, gate_up.shape[0]) else "grouped"
    both = time_graph(lambda: expert_gemv.down(expert_gemv.gate_up(x, gate_up, chosen), down, chosen, weights))
    grouped = time_graph(lambda: fused_moe.grouped_experts(x, gate_up, down, weights, chosen))
    print(f"{name:<14} tokens {tokens:<4} gemv {both:7.1f} us {limit / both / 1e3:6.0f} GB/s | grouped {grouped:7.1f} us "
          f"{limit / grouped / 1e3:6.0f} GB/s | few_pairs picks {pick}", flush=True)
    h = expert_gemv.gate_up(x, gate_up, chosen)
    for kernel, share, call in (
            ("gate_up", 2 / 3, lambda tile: lambda: expert_gemv.gate_up(x, gate_up, chosen, tiles=tile)),
            ("down", 1 / 3, lambda tile: lambda: expert_gemv.down(h, down, chosen, weights, tiles=tile))):
        own = expert_gemv.GATE_UP_TILES if kernel == "gate_up" else expert_gemv.DOWN_TILES
        row = []
        for tile in [own] + [c for c in GEMV_CANDIDATES if c != own]:
            try:
                us = time_graph(call(tile))
                row.append(f"{tile}: {us:6.1f} us {limit * share / us / 1e3:5.0f} GB/s")
            except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot hold: say so, time the rest
                row.append(f"{tile}: failed ({type(exc).__name__})")
        print(f"{'':<14} {kernel:<8} " + " | ".join(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--gemv-tokens", nargs="*", type=int, default=[1, 2, 4, 8])
    args = parser.parse_args()
    from nanoinfer.backends.cuda import expert_gemv, fused_moe

    own = fused_moe.tiles
    print(f"device {torch.cuda.get_device_name()}")
    for name in args.shapes:
        experts, k, hidden, inter = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        down = torch.randn(experts, hidden, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        expert_bytes = (2 * inter * hidden + hidden * inter) * 2
        for tokens in sorted(set(args.tokens) | set(args.gemv_tokens)):
            cpu = torch.Generator().manual_seed(tokens)
            chosen = torch.stack([torch.randperm(experts, generator=cpu)[:k] for _ in range(tokens)]).cuda()
            weights = torch.softmax(torch.randn(tokens, k, generator=cpu), -1).cuda()
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            limit = chosen.unique().numel() * expert_bytes
            if tokens in args.gemv_tokens:
                gemv_rows(name, tokens, x, gate_up, down, weights, chosen, limit, expert_gemv, fused_moe)
            if tokens not in args.tokens:
                continue
            row = []
            for tile in [own(tokens * k)] + [c for c in CANDIDATES if c != own(tokens * k)]:
                fused_moe.tiles = lambda pairs, tile=tile: tile
                try:
                    us = time_graph(lambda: fused_moe.grouped_experts(x, gate_up, down, weights, chosen))
                    row.append(f"{tile}: {us:7.1f} us {limit / us / 1e3:6.0f} GB/s")
                except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot hold: say so, time the rest
                    row.append(f"{tile}: failed ({type(exc).__name__})")
                finally:
                    fused_moe.tiles = own
            print(f"{name:<14} tokens {tokens:<4} " + " | ".join(row), flush=True)
        del gate_up, down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
