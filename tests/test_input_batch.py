"""The input batch (runtime/executor/input_batch.py) against its reference: per-row state kept between
steps and updated incrementally gives exactly what SamplingTensors.build and the sequences'
own block tables give when rebuilt from scratch."""

import random

import numpy as np
import pytest
import torch

from nanoinfer.sampling.penalties import apply_penalties
from nanoinfer.sampling.sampler import SamplingParams, SamplingTensors
from runtime.executor.input_batch import InputBatch
from runtime.engine.sequence import Sequence

VOCAB, EOS = 50, (2,)


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "plain", "sorted", "penalties"])
    if kind == "greedy":
        return SamplingParams(temperature=0, seed=rng.randrange(1000))
    kw = dict(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1000), top_k=rng.choice([0, 5]),
              top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]))
    if kind == "penalties":
        kw.update(repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
                  frequency_penalty=0.3, logit_bias={rng.randrange(VOCAB): 2.0}, min_tokens=rng.choice([0, 3]),
                  max_tokens=20, stop_token_ids=(7,))
    return SamplingParams(**kw)


def make_seqs(rng, count):
    seqs = []
    for i in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        seq = Sequence(i, prompt, random_params(rng), 64)
        seq.token_ids += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
        seq.block_table = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
        seqs.append(seq)
    return seqs


def same(a: SamplingTensors, b: SamplingTensors):
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.all_greedy, a.needs_sort, a.needs_min_p) == (b.all_greedy, b.needs_sort, b.needs_min_p)
    if b.penalties is None:  # (rows without penalties may still be gathered as neutral ones)
        return
    for name in ("output_counts", "presence", "frequency", "repetition", "bias", "banned"):
        assert torch.equal(getattr(a.penalties, name), getattr(b.penalties, name)), name
    # `seen` only matters where repetition_penalty != 1: the same logits must come out.
    logits = torch.randn(a.temperature.shape[0], VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(apply_penalties(logits, a.penalties), apply_penalties(logits, b.penalties))


@pytest.mark.parametrize("seed", range(6))
def test_rows_give_the_sampling_tensors_a_rebuild_gives(seed):
    rng = random.Random(seed)
    seqs = make_seqs(rng, 12)
    batch = InputBatch(16, 8, VOCAB, EOS, torch.device("cpu"))
    for seq in seqs[:8]:
        batch.add(seq)
    batch.remove(seqs[2])  # a row freed, and taken again below
    batch.remove(seqs[5])
    for seq in seqs[8:]:
        batch.add(seq)
    batch.flush()
    live = [s for s in seqs if s in batch]
    for round_ in range(4):
        picked = rng.sample(live, rng.randint(1, len(live)))
        rows = np.array([batch.row_of[s.seq_id] for s in picked])
        steps = torch.tensor([s.num_output_tokens for s in picked])
        ours = batch.sampling(rows, torch.from_numpy(rows), steps)
        want = SamplingTensors.build([s.params for s in picked], steps.tolist(), VOCAB, "cpu",
                                     prompts=[s.prompt_token_ids for s in picked],
                                     outputs=[s.output_token_ids for s in picked], eos_token_ids=EOS)
        same(ours, want)
        # The sampler's output is recorded on the device, as the host appends it.
        tokens = torch.tensor([rng.randrange(VOCAB) for _ in picked])
        batch.sampled(torch.from_numpy(rows), tokens)
        for seq, token in zip(picked, tokens.tolist()):
            seq.token_ids.append(token)
        assert batch.last_token[torch.from_numpy(rows)].tolist() == tokens.tolist()


def test_block_tables_follow_the_sequences():
    rng = random.Random(0)
    seqs = make_seqs(rng, 6)
    batch = InputBatch(8, 10, VOCAB, EOS, torch.device("cpu"))
    for seq in seqs:
        batch.add(seq)
    for step in range(20):
        seq = rng.choice([s for s in seqs if s in batch])
        if len(seq.block_table) < 10 and rng.random() < 0.5:
            seq.block_table.append(rng.randrange(100))  # a new block
        else:
            seq.block_table[rng.randrange(len(seq.block_table))] = rng.randrange(100)  # copy-on-write
        seq.num_computed_tokens = 0  # (the whole table is the write range)
        batch.sync_table(seq, 0)
        if step % 7 == 0:  # a sequence leaves; another takes its row
            batch.remove(seq)
            seq.block_table = [rng.randrange(100) for _ in range(3)]
            batch.add(seq)
        batch.flush()
        for s in seqs:
            row = batch.row_of[s.seq_id]
            assert batch.table_np[row, :len(s.block_table)].tolist() == s.block_table
            assert batch.table_device[row, :len(s.block_table)].tolist() == s.block_table


def identical(a: SamplingTensors, b: SamplingTensors):
    """Every field equal: values, dtypes, flags, and every penalty table."""
    for name, x, y in zip(SamplingTensors._fields, a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        elif name != "penalties":
            assert x == y, name
    assert (a.penalties is None) == (b.penalties is None)
    for name, x, y in zip(*(() if a.penalties is None else (a.penalties._fields, a.penalties, b.penalties))):
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("seed", range(8))
def test_both_entry_points_give_the_same_sampling_tensors(seed):
    """The rows a sequence joins with (InputBatch.sampling, the step's path) and a rebuild
    from the parameters and histories (SamplingTensors.build) give the same tensors in every
    field, penalties included, for a random mix of parameters."""
    rng = random.Random(seed)
    seqs = make_seqs(rng, rng.randint(1, 10))
    batch = InputBatch(12, 8, VOCAB, EOS, torch.device("cpu"))
    for seq in seqs:
        batch.add(seq)
    batch.flush()
    picked = rng.sample(seqs, len(seqs))
    rows = np.array([batch.row_of[s.seq_id] for s in picked])
    steps = torch.tensor([s.num_output_tokens for s in picked])
    identical(batch.sampling(rows, torch.from_numpy(rows), steps),
              SamplingTensors.build([s.params for s in picked], steps.tolist(), VOCAB, "cpu",
                                    prompts=[s.prompt_token_ids for s in picked],
                                    outputs=[s.output_token_ids for s in picked], eos_token_ids=EOS))
