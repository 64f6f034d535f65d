"""Which CUDA kernels give a row the same bits whatever the batch around it (issue 65's first question).

    python bench/batch_invariance_probe.py [PART ...]   # on a CUDA machine; prints counts of differing elements
                                                         # (parts: linear_and_norms attention decode_tiles
                                                         #  linear_tiles one_row_tiles)

Each line compares one row's (or one query's) result computed alone, in a prefix of the batch, or inside a larger
step with the same row computed another way; 0 means bit-identical. It decides the deterministic mode's design:
if every Triton `tl.dot` tile shape agrees, a matmul's tile may follow the row count; where a path differs (the
one-row GEMV, the decode attention beside the prefill kernel) that path must go or be made to agree.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "tests")  # (tests/tiny.py: a small model config)


@triton.jit
def _matmul(x, w, o, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """o [M, N] fp32 = x [M, K] @ w [N, K].T, no split over K."""
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        ok = k0 + tl.arange(0, BK)
        a = tl.load(x + om[:, None] * K + ok[None, :], mask=om[:, None] < M, other=0.0)
        b = tl.load(w + on[:, None] * K + ok[None, :], mask=on[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(o + om[:, None] * N + on[None, :], acc, mask=(om[:, None] < M) & (on[None, :] < N))


def matmul(x, w, bm, bn, bk, warps, stages=3):
    (M, K), N = x.shape, w.shape[0]
    o = torch.empty(M, N, dtype=torch.float32, device="cuda")
    _matmul[(triton.cdiv(M, bm), triton.cdiv(N, bn))](x, w, o, M, N, K, bm, bn, bk, num_warps=warps,
                                                      num_stages=stages)
    return o


def differ(a, b) -> int:
    return int((a != b).sum().item())


def linear_and_norms() -> None:
    from nanoinfer.backends.cuda.gemv import gemv
    from nanoinfer.backends.cuda.row_kernels import rms_norm as triton_rms_norm
    from nanoinfer.model.layers import rms_norm

    torch.manual_seed(0)
    w = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    ref = matmul(x, w, 16, 32, 256, 4)
    for cfg in [(16, 64, 128, 4), (16, 32, 64, 4), (32, 32, 64, 4), (64, 64, 64, 4), (64, 16, 64, 4),
                (64, 128, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8), (128, 64, 32, 4)]:
        print("tl.dot tiles (BM, BN, BK, warps)", cfg, "vs (16, 32, 256, 4):", differ(matmul(x, w, *cfg), ref))
    for cfg in [(16, 32, 256, 4), (128, 128, 64, 8)]:
        full = matmul(x, w, *cfg)
        print("tl.dot", cfg, "rows 1/3/17/100 alone vs in 512:",
              [differ(matmul(x[:m], w, *cfg), full[:m]) for m in (1, 3, 17, 100)])
    full = x @ w.T
    print("cuBLAS prefixes 1..256 vs in 512:",
          [differ(x[:m] @ w.T, full[:m]) for m in (1, 2, 4, 8, 16, 17, 32, 64, 128, 256)])
    print("cuBLAS vs tl.dot:", differ(full, ref.bfloat16()))
    full = gemv(x, w)
    print("gemv (the linear dispatch) prefixes 1/2/8/16/17/64:",
          [differ(gemv(x[:m], w), full[:m]) for m in (1, 2, 8, 16, 17, 64)])
    h = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(1024, device="cuda", dtype=torch.bfloat16)
    full = rms_norm(h, g, 1e-6)
    print("torch rms_norm prefixes 1/2/8/64:", [differ(rms_norm(h[:m], g, 1e-6), full[:m]) for m in (1, 2, 8, 64)])
    tri = triton_rms_norm(h, g, 1e-6)
    print("Triton rms_norm prefixes:", [differ(triton_rms_norm(h[:m], g, 1e-6), tri[:m]) for m in (1, 2, 8, 64)],
          "vs torch:", differ(tri, full))
    for vocab in (151936, 50257):
        logits = torch.randn(256, vocab, device="cuda") * 3
        full = logits.log_softmax(-1)
        print("log_softmax", vocab, "prefixes 1/2/7/64:",
              [differ(logits[:m].log_softmax(-1), full[:m]) for m in (1, 2, 7, 64)],
              "single rows 1/3/5:", [differ(logits[i:i + 1].log_softmax(-1), full[i:i + 1]) for i in (1, 3, 5)])


def attention() -> None:
    from tiny import tiny_config

    from nanoinfer.attention.triton_paged import TritonPagedAttention
    from nanoinfer.model.batch import SeqChunk, build_batch

    torch.manual_seed(0)
    block, blocks, length = 16, 600, 700
    for group, fp8 in ((2, False), (4, False), (2, True)):
        cfg = tiny_config(num_heads=8 * group, num_kv_heads=8, head_dim=128)
        kv = torch.randn(2, blocks, block, 8, 128, device="cuda").to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        q = torch.randn(length, 8 * group, 128, device="cuda", dtype=torch.bfloat16)

        def attend(chunks, queries, **kw):
            a = TritonPagedAttention(cfg, **kw)
            return a.attention(queries.contiguous(), kv, a.prepare(build_batch(chunks, block, "cuda"), cfg, None))

        table, wide = list(range(44)), list(range(520))
        last = length - 1
        whole = attend([SeqChunk([0] * length, 0, table, True)], q)[last]  # the last query of a whole prefill
        ways = {
            "prefill, 520-block table": attend([SeqChunk([0] * length, 0, wide, True)], q)[last],
            "a 100-token chunk": attend([SeqChunk([0] * 100, 600, table, True)], q[600:])[-1],
            "a 1-token chunk beside a 300-token prefill": attend(
                [SeqChunk([0] * 300, 0, table, True), SeqChunk([0], last, table, True)],
                torch.cat([q[:300], q[last:]]))[-1],
            "decode alone (split)": attend([SeqChunk([0], last, table, True)], q[last:]),
            "decode unsplit": attend([SeqChunk([0], last, table, True)], q[last:], partition_size=8192)[0],
            "decode beside 99 others": attend([SeqChunk([0], last, table, True)] + [SeqChunk([0], 300, table, True)] * 99,
                                              torch.cat([q[last:]] * 100))[0],
            "decode, 520-block table": attend([SeqChunk([0], last, wide, True)], q[last:]),
        }
        print(f"attention, GQA {group}, {'fp8' if fp8 else 'bf16'} pool, vs the whole prefill's last query:",
              {name: differ(v.reshape(whole.shape), whole) for name, v in ways.items()})


def linear_tiles() -> None:
    """Which of a tensor-core product's tile parameters change a row's bits, per weight form: rows 0-16 of an
    M-row product at one config against the same rows of a 1,100-row product at another (one parameter apart)."""
    import triton as _triton

    from nanoinfer.backends.cuda.gemv import _rows_kernel
    from nanoinfer.backends.cuda.int4_gemv import _int4_mm_kernel
    from nanoinfer.loaders.params import device_form
    from nanoinfer.loaders.quantize import int4_groups
    from nanoinfer.quant.quantized import Fp8Weight, Int8Weight

    torch.manual_seed(0)
    n, k = 1024, 3072
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(1100, k, device="cuda", dtype=torch.bfloat16)
    forms = {"bf16": (w, None), "int8": (lambda q: (q.q, q.scale))(Int8Weight.quantize(w, torch.float32)),
             "fp8": (lambda q: (q.q, q.scale))(Fp8Weight.quantize(w))}
    int4 = device_form(int4_groups(w), w.device, w.dtype)

    def product(form, m, bm, bn, bk, warps, stages=3):
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        if form == "int4":
            _int4_mm_kernel.fn[(_triton.cdiv(m, bm), _triton.cdiv(n, bn))](
                x, int4.packed, int4.scale, int4.min, out, m, n, k, x.stride(0), int4.packed.stride(0),
                int4.scale.stride(0), out.stride(0), 1, GROUP=int4.group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=warps, num_stages=stages)
            return out
        q, scale = forms[form]
        _rows_kernel.fn[(_triton.cdiv(n, bn), _triton.cdiv(m, bm))](
            x, q, q if scale is None else scale, out, m, n, k, x.stride(0), q.stride(0), out.stride(0),
            q.element_size(), HAS_SCALE=scale is not None, INT8=q.dtype == torch.int8, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return out

    pairs = {"same config (64, 128, K, 4)": ((64, 128, 0, 4), (64, 128, 0, 4)),
             "BLOCK_N 16 vs 128": ((64, 16, 0, 4), (64, 128, 0, 4)),
             "BLOCK_M 16 vs 64": ((16, 64, 0, 4), (64, 64, 0, 4)),
             "BLOCK_M 64 vs 128 (8 warps)": ((64, 128, 0, 8), (128, 128, 0, 8)),
             "BLOCK_K 2x": ((64, 64, 1, 4), (64, 64, 0, 4)),
             "warps 8 vs 4": ((64, 64, 0, 8), (64, 64, 0, 4))}
    for form in ("bf16", "int8", "fp8", "int4"):
        base_k = 128 if form == "int4" else 64
        found = {}
        for name, (small, full) in pairs.items():
            conf = lambda c: (c[0], c[1], base_k * (2 if c[2] else 1), c[3])
            whole = product(form, 1100, *conf(full))
            found[name] = [differ(product(form, m, *conf(small)), whole[:m]) for m in (1, 2, 17)]
        print(f"tensor-core product, {form}, rows 1/2/17 vs in 1,100:", found)


def one_row_tiles() -> None:
    """The deterministic product's tiles for a one-row (batch-1 decode) bf16 projection: each config's time at one
    row (a CUDA graph of 50 calls) beside the default mode's CUDA-core GEMV, and whether its row has the bits of the
    same row inside a 64-row product at INVARIANT_TILES (0: the same). Shapes: Qwen3-0.6B's and Llama-3.2-1B's."""
    import triton as _triton
    from triton.testing import do_bench_cudagraph

    from nanoinfer.backends.cuda.gemv import INVARIANT_TILES, _rows_kernel, gemv, invariant_block_n

    torch.manual_seed(0)
    shapes = {"qwen3-0.6b": ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)),
              "llama-3.2-1b": ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048))}
    configs = [(64, 16, 64, 4, 3)] + [(16, bn, bk, warps, stages) for bn in (16, 32, 64) for bk in (128, 256)
                                      for warps, stages in ((4, 4), (4, 6))]

    def product(x, w, bm, bn, bk, warps, stages):
        m, n, k = x.shape[0], w.shape[0], w.shape[1]
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        _rows_kernel.fn[(_triton.cdiv(n, bn), _triton.cdiv(m, bm))](
            x, w, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), 2, HAS_SCALE=False, INT8=False,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return out

    for name, dims in shapes.items():
        for n, k in dims:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
            x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
            t = INVARIANT_TILES
            whole = product(x, w, t["BLOCK_M"], invariant_block_n(64), t["BLOCK_K"], t["num_warps"], t["num_stages"])
            one = x[:1].contiguous()
            line = [f"gemv {do_bench_cudagraph(lambda: gemv(one, w), rep=50) * 1000:.1f}"]
            for c in configs:
                us = do_bench_cudagraph(lambda: product(one, w, *c), rep=50) * 1000
                line.append(f"{c} {us:.1f}/{differ(product(one, w, *c), whole[:1])}")
            print(f"{name} N {n} K {k} us/differing:", "  ".join(line), flush=True)


def decode_tiles() -> None:
    """The deterministic attention with other tiles for its decode steps than its prefill's (64 rows, 4 warps):
    which would keep a decode row's bits (16 rows a program wastes fewer rows of one sequence's queries)."""
    from tiny import tiny_config

    from nanoinfer.attention.triton_paged import TritonPagedAttention
    from nanoinfer.model.batch import SeqChunk, build_batch

    torch.manual_seed(0)
    block, length = 16, 700
    for group, head_dim, pool in ((2, 128, torch.bfloat16), (4, 64, torch.bfloat16), (2, 128, torch.float8_e4m3fn)):
        cfg = tiny_config(num_heads=4 * group, num_kv_heads=4, head_dim=head_dim)
        kv = torch.randn(2, 64, block, 4, head_dim, device="cuda").to(pool)
        q = torch.randn(length, 4 * group, head_dim, device="cuda", dtype=torch.bfloat16)
        a = TritonPagedAttention(cfg, device="cuda", deterministic=True)
        table = list(range(44))
        whole = a.attention(q, kv, a.prepare(build_batch([SeqChunk([0] * length, 0, table, True)], block, "cuda"),
                                             cfg, None))
        default = a.tiles
        for tiles in ((16, a.block_n, 1, 2), (16, a.block_n, 4, 2), (32, a.block_n, 2, 2), (64, a.block_n, 4, 2),
                      (128, a.block_n, 4, 2), (64, a.block_n, 8, 2)):
            a.tiles = lambda split, decode, width, t=tiles: t if decode else default(split, decode, width)
            rows = [a.attention(q[i:i + 1].contiguous(), kv, a.prepare(
                build_batch([SeqChunk([0], i, table, True)], block, "cuda"), cfg, None))[0] for i in (5, 64, 699)]
            print(f"deterministic attention, GQA {group}, d {head_dim}, {pool}: decode tiles {tiles} vs the prefill:",
                  [differ(r, whole[i]) for r, i in zip(rows, (5, 64, 699))])


if __name__ == "__main__":
    for part in sys.argv[1:] or ["linear_and_norms", "attention", "decode_tiles"]:
        globals()[part]()
