"""The batched CPU attention path against the reference on random mixed batches, both against
stale NaN/inf in the slots no step wrote, and the reference's query tiles against one call."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.attention.reference import REFERENCE, ReferenceAttention, query_tile_rows
from nanoinfer.attention.torch_paged import TorchPagedAttention
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.model.decoder import forward
from tests.tiny import random_params, tiny_config


@st.composite
def mixed_steps(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.sampled_from([None, None, 3, 20]))
    groups = draw(st.sampled_from([(4, 4), (8, 2), (8, 1)]))
    chunks, next_block = [], 0
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        n = draw(st.sampled_from([1, 1, 1, draw(st.integers(1, 9))]))
        blocks = -(-(start + n) // block_size)
        chunks.append(SeqChunk([0] * n, start, list(range(next_block, next_block + blocks)), True))
        next_block += blocks
    softcap = draw(st.sampled_from([None, None, 1.5]))  # (Gemma 2's soft-capped scores)
    return block_size, window, groups, chunks, next_block, draw(st.integers(0, 2**16)), softcap


@settings(max_examples=100, deadline=None)
@given(mixed_steps())
def test_batched_attention_equals_reference(step):
    block_size, window, (heads, kv_heads), chunks, num_blocks, seed, softcap = step
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=8, sliding_window=window, attn_softcap=softcap)
    g = torch.Generator().manual_seed(seed)
    kv_layer = torch.randn(2, num_blocks + 2, block_size, kv_heads, 8, generator=g)
    batch = build_batch(chunks, block_size)
    q = torch.randn(batch.num_tokens, heads, 8, generator=g)
    fast = TorchPagedAttention(block_size)
    expected = REFERENCE.attention(q, kv_layer, REFERENCE.prepare(batch, cfg, window))
    got = fast.attention(q, kv_layer, fast.prepare(batch, cfg, window))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [REFERENCE, TorchPagedAttention(4)], ids=["reference", "torch_paged"])
@pytest.mark.parametrize("windowed_layers", [None, (False, True)])
def test_stale_nan_and_inf_in_unwritten_slots_change_nothing(backend, windowed_layers):
    """A pool full of NaN/inf where no step wrote (block tails, padding table entries, other
    sequences' blocks) must not reach any row: masked keys are excluded, not weighted by 0."""
    cfg = tiny_config(sliding_window=5 if windowed_layers else None, windowed_layers=windowed_layers)
    params = random_params(cfg)
    block_size, prompts = 4, [[5, 9, 2, 7, 1, 8, 3], [4, 4, 6], list(range(10, 20))]
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # block 0, 10, 11: nobody's; tables padded with 0
    clean = allocate_kv_pool(cfg, 12, block_size, torch.float32, "cpu")
    poisoned = clean.clone()
    poisoned[..., 0::2] = float("nan")
    poisoned[..., 1::2] = float("inf")
    poisoned[:, 1, ..., 1::4] = float("-inf")
    chunks = [SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)]
    for step in range(4):
        batch = build_batch(chunks, block_size)
        expected = forward(params, clean, batch, cfg, REFERENCE)
        got = forward(params, poisoned, batch, cfg, backend)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        lens = [c.start_pos + len(c.token_ids) for c in chunks]
        chunks = [SeqChunk([int(t)], n, c.block_table, True) for c, t, n in zip(chunks, expected.argmax(-1), lens)]


@settings(max_examples=60, deadline=None)
@given(mixed_steps())
def test_query_tiles_equal_one_call_per_sequence(step):
    """The reference attends in query tiles (bounded memory); any tile size gives the same."""
    block_size, window, (heads, kv_heads), chunks, num_blocks, seed, softcap = step
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=8, attn_softcap=softcap)
    g = torch.Generator().manual_seed(seed)
    kv_layer = torch.randn(2, num_blocks + 2, block_size, kv_heads, 8, generator=g)
    batch = build_batch(chunks, block_size)
    q = torch.randn(batch.num_tokens, heads, 8, generator=g)
    whole, tiled = ReferenceAttention(max_score_bytes=2**40), ReferenceAttention(max_score_bytes=1)
    assert query_tile_rows(heads, 49, 2**40) >= 49 and query_tile_rows(heads, 49, 1) == 1
    expected = whole.attention(q, kv_layer, whole.prepare(batch, cfg, window))
    got = tiled.attention(q, kv_layer, tiled.prepare(batch, cfg, window))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads,context", [(9, 8000), (9, 100), (32, 131072), (64, 10**6), (1, 1)])
def test_a_query_tile_bounds_the_scores(heads, context):
    """heads x rows x keys fp32 scores stay within the budget (one row at least)."""
    budget = REFERENCE.max_score_bytes
    assert 32 * 2**20 <= budget <= 128 * 2**20
    rows = query_tile_rows(heads, context, budget)
    assert rows >= 1 and (rows == 1 or heads * rows * context * 4 <= budget)
    assert heads * (rows + 1) * context * 4 > budget  # and uses it: no needless tiny tiles
