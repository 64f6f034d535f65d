"""CPU prefill attention of one long chunk: the reference's query tiles beside one SDPA call.

    python bench/prefill_attention.py [--queries 4096] [--context 8000] [--repeats 3]

The default model's attention shape (9 heads, 3 kv heads, head_dim 64, fp32): a chunk of
`--queries` rows at the end of a `--context`-token sequence. Each variant runs in its own
process, so its peak RSS (over the inputs) is its own; time is the best of `--repeats`.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
VARIANTS = {
    "math, one call (before)": "math",
    "flash, one call": "flash",
    "flash, query tiles (reference.py)": "tiles",
}


def run_variant(kind: str, queries: int, context: int, repeats: int) -> tuple[float, float]:
    from nanoinfer.attention.reference import REFERENCE, query_tile_rows

    q = torch.randn(HEADS, queries, HEAD_DIM)
    k, v = torch.randn(KV_HEADS, context, HEAD_DIM), torch.randn(KV_HEADS, context, HEAD_DIM)
    q_pos = torch.arange(context - queries, context)

    def once():
        if kind != "tiles":
            mask = torch.arange(context)[None, :] <= q_pos[:, None]
            if kind == "math":  # 3-D inputs: the math path, [heads, queries, keys] scores
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
        rows = query_tile_rows(HEADS, context, REFERENCE.max_score_bytes)
        out = torch.empty_like(q)
        for first in range(0, queries, rows):
            last = min(first + rows, queries)
            hi = context - queries + last
            mask = torch.arange(hi)[None, :] <= q_pos[first:last, None]
            out[:, first:last] = F.scaled_dot_product_attention(q[None, :, first:last], k[None, :, :hi],
                                                                v[None, :, :hi], attn_mask=mask, enable_gqa=True)[0]
        return out

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    once()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=4096)
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args()
    if args.variant:
        print(*run_variant(args.variant, args.queries, args.context, args.repeats))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.queries} queries x {args.context} "
          f"keys, heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, fp32")
    print(f"{'variant':<36} {'best s':>8} {'peak MB':>8}")
    for name, kind in VARIANTS.items():
        line = subprocess.run([sys.executable, __file__, "--variant", kind, "--queries", str(args.queries),
                               "--context", str(args.context), "--repeats", str(args.repeats)],
                              check=True, capture_output=True, text=True).stdout.split()
        print(f"{name:<36} {float(line[0]):>8.3f} {float(line[1]):>8.0f}")


if __name__ == "__main__":
    main()
