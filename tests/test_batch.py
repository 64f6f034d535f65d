"""build_batch (numpy-vectorized) against a plain per-token construction of the same Batch; a
CUDA graph's inputs written from the host and from the device alike."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.batch import Batch, SeqChunk, build_batch, host_batch


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


@pytest.mark.parametrize("decode", [False, True])
def test_graph_inputs_are_written_alike_from_the_host_and_the_device(decode):
    """A CUDA graph's inputs (nanoinfer/graphs.py): a HostBatch written into a staging copy of
    its layout and the same batch's tensors written into the buffer itself give the same
    fields, padded: tokens at position 0 with slot -1, sequences with no keys (a mixed
    graph's padding tokens form one more sequence; its logits rows are 0 past the batch's)."""
    from nanoinfer.graphs import _fill, _Inputs

    chunks = ([SeqChunk([5], 20, [1, 2], True), SeqChunk([9], 3, [7], True)] if decode else
              [SeqChunk([5, 6, 7], 3, [4, 5], True), SeqChunk([9], 20, [1, 2], True), SeqChunk([3, 4], 0, [6], False)])
    host = host_batch(chunks, 16)
    inputs = _Inputs.of(8, 4, 3, 8, decode)
    staging = np.full(inputs.nbytes, 0xAB, dtype=np.uint8)
    device = torch.full((inputs.nbytes,), 0xAB, dtype=torch.uint8)
    _fill(inputs.views(staging), host)
    _fill(inputs.views(device), host.to("cpu"))
    a, b = inputs.views(staging), inputs.views(device)
    t, n = host.num_tokens, host.num_seqs
    for name, x, y in zip(Batch._fields, a, b):
        assert (x is None) == (y is None) == (decode and name in ("query_start_loc", "logits_indices")), name
        if x is not None:
            assert np.array_equal(x, y.numpy()) or name == "block_tables", name
    assert np.array_equal(a.block_tables[:n, :2], b.block_tables[:n, :2].numpy())
    assert a.input_ids[:t].tolist() == host.input_ids.tolist() and not a.input_ids[t:].any()
    assert not a.positions[t:].any() and (a.slot_mapping[t:] == -1).all() and not a.seq_lens[n:].any()
    if not decode:
        assert a.query_start_loc.tolist() == [0, 3, 4, 6, 8] and a.logits_indices.tolist() == [2, 3] + [0] * 6
