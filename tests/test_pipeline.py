"""Pipeline stages compose to the whole model: the stages' forwards in a row, each over its own
layers and its own KV pool, give the logits of one forward, and their pools are the whole
pool's layers."""

import pytest
import torch

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.model.decoder import forward
from nanoinfer.parallel.pipeline import Stage, stage_config, stage_layers, stage_params
from nanoinfer.parallel.shards import shard_config, shard_params
from tests.tiny import random_params, tiny_config


@pytest.mark.parametrize("layers, size, expected", [
    (4, 1, [range(0, 4)]),
    (4, 2, [range(0, 2), range(2, 4)]),
    (5, 2, [range(0, 3), range(3, 5)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
    (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
])
def test_stages_hold_every_layer_once_the_first_ones_the_extra(layers, size, expected):
    assert [stage_layers(layers, Stage(i, size)) for i in range(size)] == expected


def test_more_stages_than_layers_is_named():
    with pytest.raises(RequestError, match="pipeline_parallel_size=5 for a model of 4 layers"):
        stage_layers(4, Stage(0, 5))


def _steps(cfg, block_size=4):
    """A prefill of two sequences, then a decode step of both (their blocks apart)."""
    a, b = [5, 9, 2, 7, 1, 3], [8, 4, 6]
    prefill = build_batch([SeqChunk(a, 0, [0, 1], True), SeqChunk(b, 0, [2], True)], block_size)
    decode = build_batch([SeqChunk([11], len(a), [0, 1], True), SeqChunk([12], len(b), [2], True)], block_size)
    return prefill, decode


def _pipelined(params, cfg, size, steps, num_blocks=4, block_size=4):
    stages = [Stage(i, size) for i in range(size)]
    cfgs = [stage_config(cfg, s) for s in stages]
    parts = [stage_params(params, cfg, s) for s in stages]
    pools = [allocate_kv_pool(c, num_blocks, block_size, torch.float32, "cpu") for c in cfgs]
    out = []
    for batch in steps:
        hidden = None
        for p, c, kv in zip(parts, cfgs, pools):
            hidden = forward(p, kv, batch, c, hidden=hidden)
        out.append(hidden)
    return out, pools


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("tied, windowed", [(False, None), (True, (True, False, True))])
def test_stages_in_a_row_are_the_whole_forward(size, tied, windowed):
    cfg = tiny_config(num_layers=3, tie_word_embeddings=tied, sliding_window=2 if windowed else None,
                      windowed_layers=windowed)
    params = random_params(cfg, seed=4)
    kv = allocate_kv_pool(cfg, 4, 4, torch.float32, "cpu")
    whole = [forward(params, kv, batch, cfg) for batch in _steps(cfg)]
    staged, pools = _pipelined(params, cfg, size, _steps(cfg))
    for w, s in zip(whole, staged):
        assert torch.equal(w, s)
    assert torch.equal(torch.cat(pools), kv)


def test_a_stage_keeps_only_its_own_weights():
    cfg = tiny_config(num_layers=4)
    params = random_params(cfg, seed=1)
    first, last = (stage_params(params, cfg, Stage(i, 2)) for i in range(2))
    assert first.embed is params.embed and first.lm_head is None and first.layers == params.layers[:2]
    assert last.embed is None and last.lm_head is params.lm_head and last.layers == params.layers[2:]


def test_stages_of_tensor_parallel_shards_compose():
    """TP x PP: a rank's stage of its shard holds that stage's layers of the shard."""
    cfg = tiny_config(num_layers=4)
    params = random_params(cfg, seed=2)
    for rank in range(2):
        shard_cfg, shard = shard_config(cfg, rank, 2), shard_params(params, cfg, rank, 2)
        for i in range(2):
            stage = Stage(i, 2)
            assert stage_config(shard_cfg, stage).num_layers == 2
            assert stage_params(shard, shard_cfg, stage).layers == shard.layers[2 * i:2 * i + 2]


def test_nanochat_runs_whole():
    cfg = tiny_config(architecture="nanochat")
    with pytest.raises(RequestError, match="nanochat model runs whole"):
        stage_config(cfg, Stage(0, 2))


def _mixed_batch(logits_rows=None):
    """Four sequences: two prefill chunks (one from a cached prefix), two decodes."""
    chunks = [SeqChunk([5, 9, 2, 7, 1, 3, 4], 0, [0, 1], True), SeqChunk([12], 6, [2, 3], True),
              SeqChunk([8, 4, 6], 4, [4, 5], True), SeqChunk([11], 3, [6], True)]
    return build_batch(chunks, 4, logits_rows=logits_rows)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("logits_rows", [None, [9, 0, 3, 6, 11, 7]], ids=["last-rows", "unordered"])
def test_micro_batches_run_one_after_another_are_the_whole_step(parts, logits_rows):
    """Split, run micro-batch by micro-batch on one pool and put back in order: the whole
    step's logits and KV pool (to fp32 rounding), whatever the logits rows' order (prompt logprobs ask for many)."""
    from nanoinfer.parallel.pipeline import split_batch

    cfg = tiny_config(num_layers=2)
    params = random_params(cfg, seed=7)
    batch = _mixed_batch(logits_rows)
    whole_kv, split_kv = (allocate_kv_pool(cfg, 8, 4, torch.float32, "cpu") for _ in range(2))
    whole = forward(params, whole_kv, batch, cfg)
    micro = split_batch(batch, parts)
    assert len(micro.batches) == min(parts, 4)
    assert sum(b.num_tokens for b in micro.batches) == batch.num_tokens
    logits = torch.cat([forward(params, split_kv, b, cfg) for b in micro.batches])
    if micro.restore is not None:
        logits = logits[micro.restore]
    assert micro.restore is None if logits_rows is None or parts == 1 else micro.restore is not None
    # (equal up to the matmuls' blocking, which the token count changes)
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_kv, whole_kv, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), whole.argmax(-1))


def test_micro_batches_share_tokens_evenly_by_whole_sequences():
    """A long prefill chunk stands alone; the host's copies of the index tensors cut alike."""
    from nanoinfer.parallel.pipeline import split_batch

    batch = _mixed_batch()
    assert [b.num_seqs for b in split_batch(batch, 2).batches] == [1, 3]
    assert [b.num_seqs for b in split_batch(batch, 3).batches] == [1, 1, 2]
    host = split_batch(batch, 3, batch.query_start_loc.tolist(), batch.logits_indices.tolist())
    for a, b in zip(host.batches, split_batch(batch, 3).batches):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_micro_batch_is_the_step_itself():
    """Cut into one part (or a step of one sequence), the micro-batch is the step's own Batch:
    no index tensors copied (rank 0's host pays each copy every step)."""
    from nanoinfer.parallel.pipeline import split_batch

    batch = _mixed_batch([9, 0, 3, 6, 11, 7])
    micro = split_batch(batch, 1, batch.query_start_loc.tolist(), batch.logits_indices.tolist())
    assert len(micro.batches) == 1 and micro.batches[0] is batch and micro.restore is None
    assert split_batch(batch, 4).batches[0] is not batch
