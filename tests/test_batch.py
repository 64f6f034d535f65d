"""build_batch (numpy-vectorized) against a plain per-token construction of the same Batch."""

import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.batch import SeqChunk, build_batch


def reference_batch(chunks, block_size):
    """The Batch spelled out one token at a time."""
    ids, positions, slots, lens, qsl, logits = [], [], [], [], [0], []
    width = max((len(c.block_table) for c in chunks), default=0)
    for c in chunks:
        for offset, token in enumerate(c.token_ids):
            pos = c.start_pos + offset
            ids.append(token)
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        lens.append(c.start_pos + len(c.token_ids))
        qsl.append(qsl[-1] + len(c.token_ids))
        if c.compute_logits:
            logits.append(qsl[-1] - 1)
    tables = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
    return (ids, positions, slots, tables, lens, qsl, logits)


@st.composite
def chunk_lists(draw):
    block_size = draw(st.sampled_from([1, 3, 16]))
    chunks = []
    for _ in range(draw(st.integers(0, 6))):
        start = draw(st.integers(0, 50))
        n = draw(st.integers(0, 12))
        blocks = -(-(start + n) // block_size) + draw(st.integers(0, 2))
        table = draw(st.lists(st.integers(0, 500), min_size=blocks, max_size=blocks))
        chunks.append(SeqChunk(draw(st.lists(st.integers(0, 999), min_size=n, max_size=n)), start, table,
                               draw(st.booleans())))
    return chunks, block_size


@settings(max_examples=200, deadline=None)
@given(chunk_lists())
def test_build_batch_matches_per_token_reference(case):
    chunks, block_size = case
    batch = build_batch(chunks, block_size)
    expected = reference_batch(chunks, block_size)
    got = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
           batch.query_start_loc, batch.logits_indices)
    for tensor, values, dtype in zip(got, expected, (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32,
                                                     torch.int32, torch.int64)):
        assert tensor.dtype == dtype
        assert tensor.tolist() == values


def test_a_table_too_short_is_refused():
    import pytest

    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_batch([SeqChunk([1] * 9, 0, [0, 1], True)], 4)
