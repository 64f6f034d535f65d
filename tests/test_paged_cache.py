"""The paged cache is invisible: any chunking, block size and block placement gives the
logits of one uncached forward over the whole sequence."""

import torch
from hypothesis import given, settings, strategies as st

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.model.decoder import forward, forward_out_of_place
from tests.tiny import random_params, tiny_config

CFG = tiny_config()
PARAMS = random_params(CFG, seed=1)


def all_logits(batch):
    """Ask for the logits of every token row, not only the sampling ones."""
    return batch._replace(logits_indices=torch.arange(batch.num_tokens))


def uncached_logits(tokens):
    """One forward over the whole sequence in a fresh pool: the oracle."""
    block_size = 16
    blocks = list(range(-(-len(tokens) // block_size)))
    kv = allocate_kv_pool(CFG, len(blocks), block_size, torch.float32, "cpu")
    batch = build_batch([SeqChunk(tokens, 0, blocks, True)], block_size)
    return forward(PARAMS, kv, all_logits(batch), CFG)


@st.composite
def split_plans(draw):
    """Two sequences, each cut into random chunks, processed side by side in shared steps."""
    seqs = []
    for _ in range(2):
        length = draw(st.integers(1, 40))
        tokens = draw(st.lists(st.integers(0, CFG.vocab_size - 1), min_size=length, max_size=length))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, length - 1)), max_size=6))) - {length})
        seqs.append((tokens, [0, *cuts, length]))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    seed = draw(st.integers(0, 2**16))
    return seqs, block_size, seed


@settings(max_examples=60, deadline=None)
@given(split_plans())
def test_chunked_paged_forward_equals_uncached(plan):
    seqs, block_size, seed = plan
    needed = [-(-len(tokens) // block_size) for tokens, _ in seqs]
    num_blocks = sum(needed) + 3
    # Shuffled physical blocks: tables point anywhere in the pool, never in order.
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[: needed[0]], perm[needed[0] : needed[0] + needed[1]]]
    kv = allocate_kv_pool(CFG, num_blocks, block_size, torch.float32, "cpu")
    got = [[], []]
    steps = max(len(cuts) for _, cuts in seqs) - 1
    for step in range(steps):
        chunks, owners = [], []
        for s, (tokens, cuts) in enumerate(seqs):
            if step + 1 < len(cuts):
                lo, hi = cuts[step], cuts[step + 1]
                chunks.append(SeqChunk(tokens[lo:hi], lo, tables[s], True))
                owners.append((s, hi - lo))
        batch = all_logits(build_batch(chunks, block_size))
        logits = forward(PARAMS, kv, batch, CFG)
        row = 0
        for s, n in owners:
            got[s].append(logits[row : row + n])
            row += n
    for s, (tokens, _) in enumerate(seqs):
        torch.testing.assert_close(torch.cat(got[s]), uncached_logits(tokens), atol=1e-5, rtol=0)


def test_only_logits_indices_rows_are_computed():
    tokens = list(range(10))
    kv = allocate_kv_pool(CFG, 4, 4, torch.float32, "cpu")
    batch = build_batch([SeqChunk(tokens, 0, [2, 0, 3], True)], 4)
    logits = forward(PARAMS, kv, batch, CFG)
    assert logits.shape == (1, CFG.vocab_size)
    torch.testing.assert_close(logits[0], uncached_logits(tokens)[-1], atol=1e-5, rtol=0)
    # A non-final prefill chunk asks for no logits at all.
    kv2 = allocate_kv_pool(CFG, 4, 4, torch.float32, "cpu")
    assert forward(PARAMS, kv2, build_batch([SeqChunk(tokens, 0, [0, 1, 2], False)], 4), CFG).shape == (0, 97)


def test_kv_written_only_at_batch_slots_and_out_of_place_mode_agrees():
    block_size = 4
    kv = allocate_kv_pool(CFG, 6, block_size, torch.float32, "cpu")
    kv.normal_()  # pretend other sequences own the rest of the pool
    before = kv.clone()
    batch = build_batch([SeqChunk([5, 6, 7], 0, [4], True), SeqChunk([9], 0, [1], True)], block_size)
    logits_ref, new_kv = forward_out_of_place(PARAMS, kv, batch, CFG)
    assert torch.equal(kv, before), "out-of-place mode must leave the pool untouched"
    logits = forward(PARAMS, kv, batch, CFG)
    torch.testing.assert_close(logits, logits_ref, atol=0, rtol=0)
    assert torch.equal(kv, new_kv)
    written = torch.zeros(6, block_size, dtype=torch.bool)
    written[4, :3] = True
    written[1, 0] = True
    changed = (kv != before).flatten(start_dim=4).any(-1).any(0).any(0)  # [blocks, block_size]
    assert torch.equal(changed, written)


def test_padding_rows_write_nothing():
    kv = allocate_kv_pool(CFG, 2, 4, torch.float32, "cpu")
    batch = build_batch([SeqChunk([1, 2], 0, [0], True)], 4)
    padded = batch._replace(
        input_ids=torch.cat([batch.input_ids, torch.tensor([3])]),
        positions=torch.cat([batch.positions, torch.tensor([0])]),
        slot_mapping=torch.cat([batch.slot_mapping, torch.tensor([-1])]),
    )
    forward(PARAMS, kv, padded, CFG)
    assert torch.count_nonzero(kv[:, :, 1]) == 0 and torch.count_nonzero(kv[:, :, 0, 2:]) == 0
