"""The Triton paged-attention backend against the torch reference, on fresh random paged batches.

Needs CUDA and Triton; skipped cleanly without them. With TRITON_INTERPRET=1 the kernels run on
CPU tensors in Triton's interpreter (slow: pick tests with -k). The oracle is ReferenceAttention
run in fp32 on the same (bf16/fp16) inputs, so the tolerance measures only the kernels' own rounding.
Run as a script for a decode timing printout (not a test): python tests/test_triton_attention.py
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from nanoinfer.attention.reference import ReferenceAttention  # noqa: E402
from nanoinfer.attention.triton_paged import TritonPagedAttention  # noqa: E402
from nanoinfer.model.batch import Batch  # noqa: E402
from nanoinfer.model.config import ModelConfig  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="the Triton backend needs CUDA")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = ReferenceAttention()
# Max per-(row, head) relative L2 error against the fp32 oracle: P is rounded to the input
# dtype before P @ V (as in every flash kernel) and the output is rounded once more.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LENGTHS = (1, 15, 16, 17, 1000, 16384)


def make_cfg(num_kv_heads: int, group: int, head_dim: int, sliding_window: int | None = None,
             attn_softcap: float | None = None) -> ModelConfig:
    heads = num_kv_heads * group
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * head_dim, intermediate_size=32,
                       num_layers=1, num_heads=heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768,
                       tie_word_embeddings=False, sliding_window=sliding_window, attn_softcap=attn_softcap)


def make_step(seqs, cfg, block_size, dtype, device=DEVICE, num_pad=3, seed=0):
    """A random step: `seqs` is [(context_len, num_queries)], the queries being the context's
    last tokens. Physical blocks are shuffled (plus spare blocks nobody owns), block tables
    padded with 0, `num_pad` padding rows with slot -1 at the end, the pool full of random data.
    Returns (batch, q, k, v, kv_layer)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed) + 2
    tables, slots, positions, seq_lens, query_start_loc = [], [], [], [], [0]
    for (ctx, n), needed in zip(seqs, blocks_needed):
        own, perm = perm[:needed], perm[needed:]
        tables.append(own + [0] * (width - needed))
        for pos in range(ctx - n, ctx):
            positions.append(pos)
            slots.append(own[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(ctx)
        query_start_loc.append(query_start_loc[-1] + n)
    total = query_start_loc[-1] + num_pad
    slots += [-1] * num_pad
    positions += [0] * num_pad

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    batch = Batch(
        input_ids=torch.zeros(total, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(query_start_loc[1:], dtype=torch.int64, device=device) - 1,
    )
    kv_layer = randn(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    # k, v as strided views of one qkv-like tensor, as forward hands them over.
    kv_new = randn(total, 2 * cfg.num_kv_heads, cfg.head_dim)
    k, v = kv_new[:, : cfg.num_kv_heads], kv_new[:, cfg.num_kv_heads :]
    return batch, randn(total, cfg.num_heads, cfg.head_dim), k, v, kv_layer


def run_and_check(backend, batch, cfg, q, kv_layer, dtype, tolerance=None):
    """Backend output (into a NaN-poisoned buffer) against the fp32 reference."""
    out = torch.full_like(q, float("nan"))
    returned = backend.attention(q, kv_layer, backend.prepare(batch, cfg, cfg.sliding_window), out=out)
    assert returned is out
    expected = REF.attention(q.float(), kv_layer.float(), REF.prepare(batch, cfg, cfg.sliding_window))
    num_valid = int(batch.query_start_loc[-1])
    got = out[:num_valid].float()
    assert not got.isnan().any(), f"{int(got.isnan().any(-1).any(-1).sum())} rows unwritten or NaN"
    ref = expected[:num_valid]
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)  # [rows, heads]
    worst = int(err.amax(-1).argmax())
    assert err.max() < (tolerance or TOLERANCE[dtype]), f"rel err {err.max():.3g} at row {worst}"
    # Padding rows past the last sequence come out zero, as in the reference.
    assert torch.equal(out[num_valid:], torch.zeros_like(out[num_valid:]))


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())  # unlike hash(str), stable across processes


def decode_seqs(rng):
    seqs = [(n, 1) for n in LENGTHS] + [(rng.randint(1, 3000), 1) for _ in range(4)]
    rng.shuffle(seqs)
    return seqs


def mixed_seqs(rng, large: bool):
    """Prefill chunks with and without cached prefixes, and decodes, in one step. `large` has
    more query rows than max_split_tokens (unsplit kernel); the small one takes the split path."""
    seqs = [(16384, 1), (1000, 1), (17, 1), (1, 1), (150, 50), (40, 40), (33, 17), (16, 16),
            (rng.randint(100, 3000), rng.randint(1, 40))]
    if large:
        seqs += [(700, 700), (1300, 300), (2000, 64), (15, 15)]
    rng.shuffle(seqs)
    return seqs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (8, 128), (3, 128), (2, 80), (3, 96)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_write_kv_matches_reference_bitwise(block_size, kv_heads, head_dim, dtype):
    cfg = make_cfg(kv_heads, 1, head_dim)
    batch, _, k, v, kv_layer = make_step([(40, 40), (100, 7), (16, 1), (1, 1)], cfg, block_size, dtype, num_pad=5)
    ours, theirs = kv_layer.clone(), kv_layer.clone()
    TritonPagedAttention(cfg, device=DEVICE).write_kv(ours, k, v, batch.slot_mapping)
    REF.write_kv(theirs, k, v, batch.slot_mapping)
    assert torch.equal(ours, theirs)  # also: padding rows (slot -1) wrote nothing
    assert not torch.equal(ours, kv_layer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 96])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_split_k(block_size, group, head_dim, dtype):
    cfg = make_cfg(2, group, head_dim)
    seed = seed_of(block_size, group, head_dim, dtype)
    batch, q, _, _, kv_layer = make_step(decode_seqs(random.Random(seed)), cfg, block_size, dtype, seed=seed)
    run_and_check(TritonPagedAttention(cfg, device=DEVICE), batch, cfg, q, kv_layer, dtype)


def test_decode_partitions_are_fine_only_for_few_programs_over_wide_tables():
    """`partitions`: 64-key partitions for a decode step of at most 16 (sequence, kv head)
    programs whose table is wider than 256 keys; 512-key ones otherwise, none past
    max_split_tokens rows; and the graph widths where that changes."""
    att = TritonPagedAttention(make_cfg(8, 4, 128), device=DEVICE)
    assert att.partitions(1, 1, 8, 256) == 1  # (no wider than fine_from: one program)
    assert att.partitions(1, 1, 8, 512) == 8 and att.partitions(2, 2, 8, 2048) == 32
    assert att.partitions(4, 4, 8, 512) == 1 and att.partitions(4, 4, 8, 2048) == 4  # (32 programs: coarse)
    assert att.partitions(40, 2, 8, 2048) == 4  # (a prefill chunk: coarse)
    assert att.partitions(att.max_split_tokens + 1, 1, 8, 2048) == 1
    assert att.graph_widths(16) == (16, 32)


@pytest.mark.parametrize("contexts", [[300], [2000], [1000, 37], [255], [100]])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_few_sequences_decode_in_fine_partitions(contexts, head_dim, group):
    """A decode step of few (sequence, kv head) programs cuts a wide table's context into
    `fine_partition`-key partitions (latency), a narrow one's not: against the reference, and
    the same step with more programs allowed coarse partitions only (`few_programs=0`) too."""
    cfg = make_cfg(8, group, head_dim)
    seed = seed_of(sum(contexts), group, head_dim)
    batch, q, _, _, kv_layer = make_step([(n, 1) for n in contexts], cfg, 16, torch.bfloat16, num_pad=0, seed=seed)
    fine = TritonPagedAttention(cfg, device=DEVICE)
    width = batch.block_tables.shape[1] * 16
    parts = fine.partitions(len(contexts), len(contexts), 8, width)
    assert parts == (1 if width <= 256 else -(-width // 64)), (width, parts)
    run_and_check(fine, batch, cfg, q, kv_layer, torch.bfloat16)
    run_and_check(TritonPagedAttention(cfg, device=DEVICE, few_programs=0), batch, cfg, q, kv_layer, torch.bfloat16)


@pytest.mark.parametrize("contexts", [[2000], [1000, 37]])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_few_sequences_decode_in_fine_partitions_over_an_fp8_pool(contexts, head_dim):
    """The same over an e4m3 pool with a GQA group of 4 (the tensor-core kernel's fp8 loads;
    groups of 1 and 2 take triton_decode_cc's kernel, which keeps coarse partitions)."""
    from nanoinfer.model.kv_cache import FP8, to_kv

    cfg = make_cfg(8, 4, head_dim)
    seed = seed_of(sum(contexts), head_dim, "fp8")
    batch, q, _, _, kv_layer = make_step([(n, 1) for n in contexts], cfg, 16, torch.bfloat16, num_pad=0, seed=seed)
    fine = TritonPagedAttention(cfg, device=DEVICE)
    width = batch.block_tables.shape[1] * 16
    assert fine.partitions(len(contexts), len(contexts), 8, width) == -(-width // 64)
    run_and_check(fine, batch, cfg, q, to_kv(kv_layer * 4, FP8), torch.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 128, 96, 256])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_unsplit(block_size, group, head_dim):
    """The unsplit decode launch (its own tile length and pipeline depth) against the reference."""
    cfg = make_cfg(2, group, head_dim)
    seed = seed_of(block_size, group, head_dim)
    batch, q, _, _, kv_layer = make_step(decode_seqs(random.Random(seed)), cfg, block_size, torch.bfloat16, seed=seed)
    run_and_check(TritonPagedAttention(cfg, device=DEVICE, max_split_tokens=0), batch, cfg, q, kv_layer, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 96])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_mixed_step_write_then_attend(group, head_dim, dtype):
    """A whole layer step: write the new k, v (checked bitwise), then attend over the pool."""
    block_size = 16 if dtype == torch.bfloat16 else 32
    cfg = make_cfg(2, group, head_dim)
    backend = TritonPagedAttention(cfg, device=DEVICE, max_split_tokens=256)
    for large in (False, True):
        seed = seed_of(group, head_dim, dtype, large)
        batch, q, k, v, kv_layer = make_step(mixed_seqs(random.Random(seed), large), cfg, block_size, dtype, seed=seed)
        assert (batch.num_tokens > 256) == large
        expected_kv = kv_layer.clone()
        REF.write_kv(expected_kv, k, v, batch.slot_mapping)
        backend.write_kv(kv_layer, k, v, batch.slot_mapping)
        assert torch.equal(kv_layer, expected_kv)
        run_and_check(backend, batch, cfg, q, kv_layer, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 128), (2, 96)])
def test_fp8_pool_write_then_attend(group, head_dim, dtype):
    """An e4m3 pool (kv_cache_dtype="fp8"): stores round and saturate as the torch path's do
    (bitwise), and attention over the pool matches the fp32 reference over the same values
    (e4m3 widens exactly to bf16/fp16), split, unsplit and prefill alike."""
    from nanoinfer.model.kv_cache import FP8, to_kv

    cfg = make_cfg(2, group, head_dim)
    for split_tokens, large in ((256, False), (256, True), (0, False)):
        backend = TritonPagedAttention(cfg, device=DEVICE, max_split_tokens=split_tokens)
        seed = seed_of(group, head_dim, dtype, large, split_tokens)
        batch, q, k, v, kv_layer = make_step(mixed_seqs(random.Random(seed), large), cfg, 16, dtype, seed=seed)
        kv_layer = to_kv(kv_layer * 50, FP8)  # (some values past 448: they must saturate, not turn NaN)
        k = k * 200
        expected_kv = kv_layer.clone()
        REF.write_kv(expected_kv, k, v, batch.slot_mapping)
        backend.write_kv(kv_layer, k, v, batch.slot_mapping)
        assert kv_layer.dtype == FP8 and not kv_layer.float().isnan().any()
        assert torch.equal(kv_layer.view(torch.uint8), expected_kv.view(torch.uint8))
        run_and_check(backend, batch, cfg, q, kv_layer, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (2, 96), (1, 32)])
@pytest.mark.parametrize("num_seqs", [3, 40], ids=["split", "unsplit"])
@pytest.mark.parametrize("window", [None, 100])
def test_fp8_decode_on_cuda_cores(group, head_dim, num_seqs, window, dtype, monkeypatch):
    """A decode step over an fp8 pool with a GQA group of 1 or 2 runs triton_decode_cc's
    kernel: against the fp32 reference over the same e4m3 values, split into partitions
    (few sequences) and not, with and without a window."""
    from nanoinfer.attention import triton_decode_cc
    from nanoinfer.model.kv_cache import FP8, to_kv

    calls = []
    kernel = triton_decode_cc.decode_attention
    monkeypatch.setattr(triton_decode_cc, "decode_attention", lambda *a: calls.append(a[9]) or kernel(*a))
    cfg = make_cfg(8, group, head_dim, sliding_window=window)
    backend = TritonPagedAttention(cfg, device=DEVICE)
    seed = seed_of(group, head_dim, num_seqs, window, dtype)
    rng = random.Random(seed)
    seqs = [(1, 1), (17, 1), (1000, 1)] + [(rng.randint(1, 3000), 1) for _ in range(num_seqs - 3)]
    rng.shuffle(seqs)  # (a context of 1000: the split case has partitions to make)
    batch, q, _, _, kv_layer = make_step(seqs, cfg, 16, dtype, num_pad=0, seed=seed)
    # (q.k's and P.V's in-thread sums are fp16 multiply-adds: bf16's tolerance for both types)
    run_and_check(backend, batch, cfg, q, to_kv(kv_layer * 4, FP8), dtype, tolerance=TOLERANCE[torch.bfloat16])
    assert len(calls) == 1 and (calls[0] > 1) == (num_seqs == 3)  # the kernel ran, split as asked


@pytest.mark.parametrize("group,head_dim", [(1, 64), (1, 128), (4, 64), (4, 128), (2, 32), (3, 96)])
def test_block_size_one(group, head_dim):
    cfg = make_cfg(2, group, head_dim)
    backend = TritonPagedAttention(cfg, device=DEVICE)
    for large in (False, True):
        batch, q, _, _, kv_layer = make_step(mixed_seqs(random.Random(7), large), cfg, 1, torch.bfloat16, seed=7)
        run_and_check(backend, batch, cfg, q, kv_layer, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [1, 16, 100, 4096])
def test_sliding_window(window, dtype):
    cfg = make_cfg(2, 4, 128, sliding_window=window)
    backend = TritonPagedAttention(cfg, device=DEVICE)
    for large in (False, True):
        seed = window + large
        batch, q, _, _, kv_layer = make_step(mixed_seqs(random.Random(seed), large), cfg, 16, dtype, seed=seed)
        run_and_check(backend, batch, cfg, q, kv_layer, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("window", [None, 100])
def test_soft_capped_scores(cap, window, dtype):
    """Gemma 2's soft-cap (tanh(s / c) * c of the scaled scores) in the split decode, the unsplit and the mixed
    launches, with and without a window; 0.5 bends every score, 50 almost none."""
    cfg = make_cfg(2, 4, 128, sliding_window=window, attn_softcap=cap)
    backend = TritonPagedAttention(cfg, device=DEVICE)
    rng = random.Random(seed_of(cap, window))
    for seqs in (decode_seqs(rng), mixed_seqs(rng, False), mixed_seqs(rng, True)):
        batch, q, _, _, kv_layer = make_step(seqs, cfg, 16, dtype, seed=rng.randint(0, 1000))
        run_and_check(backend, batch, cfg, q * 4, kv_layer, dtype)  # (scores of several units: the cap bends them)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [48, 80, 96, 112, 160, 192, 256])
def test_any_even_head_dim_up_to_256(head_dim, dtype):
    """Head dims that are not a power of two run in tiles padded to the next one (masked)."""
    cfg = make_cfg(2, 4, head_dim, sliding_window=100)
    backend = TritonPagedAttention(cfg, device=DEVICE, max_split_tokens=256)
    for large in (False, True):
        batch, q, _, _, kv_layer = make_step(mixed_seqs(random.Random(head_dim), large), cfg, 16, dtype, seed=head_dim)
        run_and_check(backend, batch, cfg, q, kv_layer, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_decode_step_captures_in_cuda_graph():
    """No host sync in write_kv/attention: a decode step captures in a CUDA graph and replays."""
    cfg = make_cfg(2, 4, 128)
    backend = TritonPagedAttention(cfg, device=DEVICE)
    batch, q, k, v, kv_layer = make_step(decode_seqs(random.Random(3)), cfg, 16, torch.bfloat16, seed=3)
    expected_kv = kv_layer.clone()
    REF.write_kv(expected_kv, k, v, batch.slot_mapping)
    meta = backend.prepare(batch, cfg, cfg.sliding_window)
    out = torch.empty_like(q)
    backend.attention(q, kv_layer.clone(), meta, out=out)  # compile outside the capture
    backend.write_kv(kv_layer.clone(), k, v, batch.slot_mapping)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.write_kv(kv_layer, k, v, batch.slot_mapping)
        backend.attention(q, kv_layer, meta, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kv_layer, expected_kv)
    expected = REF.attention(q.float(), kv_layer.float(), REF.prepare(batch, cfg, cfg.sliding_window))
    num_valid = int(batch.query_start_loc[-1])
    err = (out.float() - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)
    assert err[:num_valid].max() < TOLERANCE[torch.bfloat16] and torch.equal(out[num_valid:], expected[num_valid:].to(out.dtype))


@pytest.mark.parametrize("head_dim", [258, 512])
def test_unsupported_head_dim_is_a_clear_error(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        TritonPagedAttention(make_cfg(2, 1, head_dim))


def _bench_decode():
    """Decode timings, ours (split-K and unsplit) against the reference: one table."""
    from triton.testing import do_bench

    cfg = make_cfg(8, 4, 128)  # Llama-3-8B attention shapes: 32 heads, 8 kv heads
    print(f"device: {torch.cuda.get_device_name()}; bf16, block 16, heads 32/8, head_dim 128")
    print(f"{'batch x context':>16} {'split-K ms':>11} {'GB/s':>6} {'unsplit ms':>11} {'reference ms':>13}")
    for batch_size, context in ((64, 2048), (8, 8192), (1, 16384)):
        batch, q, _, _, kv_layer = make_step([(context, 1)] * batch_size, cfg, 16, torch.bfloat16, num_pad=0)
        times = []
        for backend in (TritonPagedAttention(cfg, device=DEVICE),
                        TritonPagedAttention(cfg, device=DEVICE, max_split_tokens=0), REF):
            meta = backend.prepare(batch, cfg, cfg.sliding_window)
            times.append(do_bench(lambda: backend.attention(q, kv_layer, meta), warmup=50, rep=200,
                                  return_mode="median"))
        kv_bytes = batch_size * context * cfg.num_kv_heads * cfg.head_dim * 2 * 2
        print(f"{batch_size:>7} x {context:<6} {times[0]:>11.4f} {kv_bytes / times[0] / 1e6:>6.0f} "
              f"{times[1]:>11.4f} {times[2]:>13.3f}")


if __name__ == "__main__":
    _bench_decode()
