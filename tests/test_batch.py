"""build_batch (numpy-vectorized) against a plain per-token construction of the same Batch; a
CUDA graph's inputs written from the host and from the device alike."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.model.batch import Batch, SeqChunk, build_batch, host_batch


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
    """A CUDA graph's inputs (nanoinfer/backends/cuda/graphs.py): a HostBatch written into a staging copy of
    its layout and the same batch's tensors written into the buffer itself give the same
    fields, padded: tokens at position 0 with slot -1, sequences with no keys (a mixed
    graph's padding tokens form one more sequence; its logits rows are 0 past the batch's)."""
    from nanoinfer.backends.cuda.graphs import _fill, _Inputs

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


def reference_step_batch(inp, draft_tokens, batch_rows, block_size):
    """The Batch of a model runner's step spelled out one token at a time: each pending token
    from its sequence on the host, or (sampled by the step in flight) its row's last token on
    the device; then the chunk's drafts, in order; a block-table width of the longest context."""
    ids, positions, slots, lens, qsl = [], [], [], [], [0]
    drafts = iter(draft_tokens.tolist())
    for seq, start, n, num_drafts, _ in inp.chunks:
        for pos in range(start, start + n):
            if pos >= start + n - num_drafts:
                ids.append(next(drafts))
            elif pos < len(seq.token_ids):
                ids.append(seq.token_ids[pos])
            else:
                ids.append(batch_rows.last_token[batch_rows.row_of[seq.seq_id]].item())
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        lens.append(start + n)
        qsl.append(qsl[-1] + n)
    width = max((-(-end // block_size) for end in lens), default=0)
    tables = [(list(seq.block_table) + [0] * width)[:width] for seq, *_ in inp.chunks]
    return (ids, positions, slots, tables, lens, qsl, list(inp.logits_rows))


@pytest.mark.parametrize("seed", range(40))
def test_the_model_runners_step_batch_matches_per_token_reference(seed):
    """ModelRunner._build lays out its input batch's rows with the layout host_batch uses
    (nanoinfer.model.batch.layout): for a random mix of prefill chunks, decodes, decodes of a token
    still in flight and verifications of drafts, every field equals the per-token reference."""
    import random
    import types

    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.engine.sequence import Sequence
    from runtime.executor.input_batch import InputBatch
    from runtime.executor.model_runner import ModelRunner
    from runtime.executor.step import Chunk, StepInput

    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 16])
    rows = InputBatch(12, 64 // block_size + 4, 1000, (2,), torch.device("cpu"))
    chunks, draft_tokens = [], []
    for i in range(rng.randint(0, 8)):
        seq = Sequence(i, [rng.randrange(1000) for _ in range(rng.randint(1, 40))], SamplingParams(), 64)
        kind = rng.choice(["prefill", "decode", "in flight", "drafts"])
        if kind == "prefill":
            start = rng.randrange(seq.num_prompt_tokens)
            n, num_drafts = rng.randint(1, seq.num_prompt_tokens - start), 0
        else:
            seq.token_ids += [rng.randrange(1000) for _ in range(rng.randint(1, 5))]
            seq.num_unresolved = int(kind == "in flight")
            start = seq.num_tokens - 1
            num_drafts = rng.randint(1, 4) if kind == "drafts" else 0
            n = 1 + num_drafts
        seq.block_table = rng.sample(range(500), -(-(start + n) // block_size) + rng.randint(0, 2))
        rows.add(seq)
        draft_tokens += [rng.randrange(1000) for _ in range(num_drafts)]
        chunks.append(Chunk(seq, start, n, num_drafts))
    rows.flush()
    rows.last_token.random_(0, 1000, generator=torch.Generator().manual_seed(seed))  # (the step in flight's samples)
    total = sum(c.num_tokens for c in chunks)
    logits_rows = tuple(sorted(rng.sample(range(total), rng.randint(0, total))))
    samplers = tuple((c.seq, i) for i, c in enumerate(chunks))
    inp = StepInput(tuple(chunks), logits_rows, samplers)
    drafts = torch.tensor(draft_tokens, dtype=torch.int64)
    runner = types.SimpleNamespace(batch=rows, block_size=block_size, device=torch.device("cpu"),  # (what _build reads)
                                   queue_pending=lambda: None, staging=None)  # (no step before with its sampling pending)
    batch, sampler_rows, (sampler_rows_t, steps_t) = ModelRunner._build(runner, inp, drafts)
    for name, tensor, values, dtype in zip(Batch._fields, batch, reference_step_batch(inp, drafts, rows, block_size),
                                           (torch.int64,) * 3 + (torch.int32,) * 3 + (torch.int64,)):
        assert tensor.dtype == dtype, name
        assert tensor.tolist() == values, name
    assert sampler_rows.tolist() == sampler_rows_t.tolist() == [rows.row_of[c.seq.seq_id] for c in chunks]
    assert steps_t.tolist() == [c.seq.num_tokens - c.seq.num_prompt_tokens for c in chunks]
