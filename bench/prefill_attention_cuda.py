"""CUDA prefill attention of one chunk over a long context: our paged kernel's tile choices beside torch's FlashAttention.

    python bench/prefill_attention_cuda.py [--shapes qwen3-0.6b llama-3.1-8b] [--cases 4096:4096 4096:32768 ...]

A case `Q:C` is a chunk of Q queries at the end of a C-token sequence, causal (C == Q: a fresh prompt in one
chunk). Ours (nanoinfer/attention/triton_paged.py) reads K/V from a paged pool of 16-token blocks through the block
table, each tile config in `--tiles` (query rows, keys, warps, stages); torch's FlashAttention gets the same K/V
contiguous: `scaled_dot_product_attention` (lower-right causal when C > Q) and, where this torch has it,
`torch.nn.attention.varlen.varlen_attn`. Prints ms (median of `--repeats` after a warm-up) and TFLOP/s of the
causal work (4 heads d per visible query-key pair). bench/long_context.py times the whole prefill.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.shapes import SHAPES

DEFAULT_TILES = ["64,64,4,2", "128,64,4,2", "128,64,4,3", "128,128,4,2", "128,32,4,2", "256,64,8,2", "256,64,8,3",
                 "128,64,4,1", "256,32,8,2"]


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def flops(heads: int, d: int, queries: int, context: int) -> float:
    pairs = queries * (context - queries) + queries * (queries + 1) / 2
    return 4 * heads * d * pairs


def main() -> None:
    from nanoinfer.attention.triton_paged import TritonMetadata, TritonPagedAttention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--cases", nargs="+", default=["4096:4096", "4096:32768", "4096:65536", "16384:32768",
                                                  "32768:32768"])
    p.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, help="query rows,keys,warps,stages")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    varlen = getattr(getattr(torch.nn.attention, "varlen", None), "varlen_attn", None)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  varlen_attn: {varlen is not None}")
    block = 16
    for name in a.shapes:
        cfg = SHAPES[name]
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        attn = TritonPagedAttention(cfg)
        default_long = attn.long_prefill_tiles
        for case in a.cases:
            q_len, ctx = map(int, case.split(":"))
            torch.manual_seed(0)
            blocks = -(-ctx // block)
            kv = torch.randn(2, blocks, block, kvh, d, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(q_len, h, d, device="cuda", dtype=torch.bfloat16)
            meta = TritonMetadata(torch.arange(blocks, device="cuda", dtype=torch.int32)[None],
                                  torch.tensor([ctx], device="cuda", dtype=torch.int32),
                                  torch.tensor([0, q_len], device="cuda", dtype=torch.int32), d ** -0.5, 0)
            work = flops(h, d, q_len, ctx)
            k = kv[0].flatten(0, 1)[:ctx]  # [ctx, kvh, d]
            v = kv[1].flatten(0, 1)[:ctx]
            rows = {}
            for tiles in a.tiles:
                attn.prefill_tiles = attn.long_prefill_tiles = tuple(map(int, tiles.split(",")))
                try:
                    rows[f"ours {tiles}"] = timed(lambda: attn.attention(q, kv, meta), a.repeats)
                except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory): say so
                    print(f"  {name} {case} ours {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
            attn.prefill_tiles, attn.long_prefill_tiles = TritonPagedAttention(cfg).prefill_tiles, default_long
            rows["ours (default)"] = timed(lambda: attn.attention(q, kv, meta), a.repeats)
            ref = attn.attention(q, kv, meta).float()
            qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if ctx == q_len:
                sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            else:
                from torch.nn.attention.bias import causal_lower_right

                bias = causal_lower_right(q_len, ctx)
                kt_full = kt.repeat_interleave(h // kvh, 1)  # (the lower-right bias path takes no enable_gqa)
                vt_full = vt.repeat_interleave(h // kvh, 1)
                sdpa = lambda: F.scaled_dot_product_attention(qt, kt_full, vt_full, attn_mask=bias)
            try:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    rows["torch SDPA flash"] = timed(sdpa, a.repeats)
                    err = (sdpa()[0].transpose(0, 1).float() - ref).abs().max().item()
                    print(f"  {name} {case}: |ours - SDPA flash| max {err:.3g}")
            except Exception as exc:  # noqa: BLE001
                print(f"  {name} {case} SDPA flash: {type(exc).__name__}: {str(exc)[:160]}")
            if varlen is not None:
                cu_q = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
                cu_k = torch.tensor([0, ctx], device="cuda", dtype=torch.int32)
                try:
                    import inspect

                    params = inspect.signature(varlen).parameters
                    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
                    if "enable_gqa" in params:
                        kw["enable_gqa"] = True
                    kk, vv = (k, v) if "enable_gqa" in params else (k.repeat_interleave(h // kvh, 1),
                                                                     v.repeat_interleave(h // kvh, 1))
                    run = lambda: varlen(q, kk, vv, cu_q, cu_k, q_len, ctx, **kw)
                    rows["torch varlen_attn"] = timed(run, a.repeats)
                    err = (run().float() - ref).abs().max().item()
                    print(f"  {name} {case}: |ours - varlen_attn| max {err:.3g}")
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} {case} varlen_attn: {type(exc).__name__}: {str(exc)[:160]}")
            for label, ms in rows.items():
                print(f"{name:<14}{case:>12}  {label:<22}{ms:>9.3f} ms {work / ms / 1e9:>8.1f} TFLOP/s")
            del kv, q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
