"""The batched CPU attention path against the reference on random mixed batches."""

import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.attention.reference import REFERENCE
from nanoinfer.attention.torch_paged import TorchPagedAttention
from nanoinfer.batch import SeqChunk, build_batch
from tests.tiny import tiny_config


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
    return block_size, window, groups, chunks, next_block, draw(st.integers(0, 2**16))


@settings(max_examples=100, deadline=None)
@given(mixed_steps())
def test_batched_attention_equals_reference(step):
    block_size, window, (heads, kv_heads), chunks, num_blocks, seed = step
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=8, sliding_window=window)
    g = torch.Generator().manual_seed(seed)
    kv_layer = torch.randn(2, num_blocks + 2, block_size, kv_heads, 8, generator=g)
    batch = build_batch(chunks, block_size)
    q = torch.randn(batch.num_tokens, heads, 8, generator=g)
    fast = TorchPagedAttention(block_size)
    expected = REFERENCE.attention(q, kv_layer, REFERENCE.prepare(batch, cfg, window))
    got = fast.attention(q, kv_layer, fast.prepare(batch, cfg, window))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
