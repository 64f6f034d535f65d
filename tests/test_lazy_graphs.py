"""CUDA graphs captured on first use (nanoinfer/backends/cuda/graphs.py, `cuda_graph_capture="lazy"`), emulated
on the CPU (tests/fake_cuda_graphs.py): at start only the largest mixed and decode buckets, each
other bucket when a step first needs it, once; the engine's greedy tokens equal those of capturing
every bucket at start and of no graphs; tensor-parallel ranks capture the buckets rank 0 does,
in its order."""

import json

import pytest
import torch

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.backends.cuda.graphs import StepGraphs
from nanoinfer.sampling.sampler import SamplingParams
from tests.tiny import random_params, tiny_config

BS = 4  # tokens per block
# The engine's sizes below: decode buckets 1, 2, 4, 8 sequences at block-table widths 2 (the
# emulation's split-K partition) and 128 (512 tokens); mixed buckets 16, 24, 32 tokens.
SMALL = dict(block_size=BS, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=32)
DECODE_SIZES, WIDTHS, TOKEN_BUCKETS = (1, 2, 4, 8), (2, 128), (16, 24, 32)
START = [32, (8, 128)]  # what a lazy start captures: the largest mixed bucket, then the largest decode one
# Prompts and their lengths of output: sequences finish one by one (decode batches of 7 down to
# 1), their contexts grow past 8 tokens (the narrow width), and the first step's prompts overflow
# the 32-token budget (a chunked prefill beside the first decodes).
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9] * 11, [10, 11, 12, 13], [14] * 9, [15, 16], [17] * 7]
LATE = [20, 21, 22, 23, 24, 25]  # a prompt added a few steps in (a mixed step of it and the decodes)


@pytest.fixture(scope="module")
def model():
    """9 query heads over 3 KV heads (two ranks: 3 + 6)."""
    from pathlib import Path

    from nanoinfer.loaders import LoadedModel

    cfg = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=72, num_layers=2)
    return LoadedModel(cfg, random_params(cfg, seed=5), None, Path("tiny"))


@pytest.fixture
def fakes(monkeypatch):
    """The emulation installed (undone after the test), its capture log emptied; and a log of
    each StepGraphs' captures and of the buckets of the batches it replayed (`expected_key`)."""
    from tests import fake_cuda_graphs

    fake_cuda_graphs.install(monkeypatch.setattr)
    monkeypatch.setattr(fake_cuda_graphs, "CAPTURES", [])
    log = {"captured": [], "replayed": []}  # (the StepGraphs, a bucket)
    real_run, real_capture = StepGraphs.run, StepGraphs._capture

    def run(self, batch, *args, **kwargs):
        log["replayed"].append((self, expected_key(self, batch)))
        return real_run(self, batch, *args, **kwargs)

    def capture(self, key):
        log["captured"].append((self, key))
        return real_capture(self, key)

    monkeypatch.setattr(StepGraphs, "run", run)
    monkeypatch.setattr(StepGraphs, "_capture", capture)
    return fake_cuda_graphs, log


def expected_key(graphs: StepGraphs, batch):
    """The bucket a batch replays: the smallest of `graphs`' sizes that holds it (this test's
    own reckoning)."""
    n, t = batch.num_seqs, batch.num_tokens
    if n == t:
        width = batch.block_tables.shape[1]
        return min(b for b in graphs.buckets if b >= n), min(w for w in graphs.widths if w >= width)
    return min(b for b in graphs.token_buckets if b >= t)


def assert_captured_on_first_use(log) -> int:
    """Each StepGraphs (the target's, a draft's) captured its largest mixed and decode buckets,
    then each bucket it replayed, at its first use, once, and nothing else. Returns the
    captures on first use."""
    late = 0
    for graphs in {id(g): g for g, _ in log["captured"]}.values():
        captured = [k for g, k in log["captured"] if g is graphs]
        used = list(dict.fromkeys(k for g, k in log["replayed"] if g is graphs))
        start = [max(graphs.token_buckets), (max(graphs.buckets), max(graphs.widths))]
        assert captured == start + [k for k in used if k not in start]
        late += len(captured) - len(start)
    return late


def greedy_run(model, draft_model=None, **config) -> list[list[int]]:
    """Each request's tokens (PROMPTS, then LATE three steps in), greedy."""
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    core = EngineCore(model, engine_config(**SMALL, **config), draft_model=draft_model)
    try:
        ids = [core.add_request(p, SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
               for i, p in enumerate(PROMPTS)]
        outs: dict = {}
        steps = 0
        while core.has_unfinished():
            for out in core.step():
                outs.setdefault(out.seq.seq_id, []).append(out.token_id)
            steps += 1
            if steps == 3:
                ids.append(core.add_request(LATE, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    finally:
        core.close()
    assert len(outs) == len(ids)
    return [outs[k] for k in sorted(outs)]


def test_a_lazy_start_captures_the_largest_buckets_and_a_step_its_own_once(fakes):
    """StepGraphs alone: capture() takes the largest mixed and decode buckets (largest first);
    `run` captures a bucket at its first use only, and every replay returns the step's own
    outputs for the batch; no step replays before capture()."""
    fake, _ = fakes

    def step(batch):  # (a row per logits row, from every input the graphs pad)
        rows = batch.logits_indices
        keys = batch.seq_lens.repeat_interleave(batch.query_start_loc.diff())
        return (batch.input_ids[rows] * 1000 + batch.positions[rows] * 10 + keys[rows]
                + batch.block_tables[:, 0].repeat_interleave(batch.query_start_loc.diff())[rows],)

    graphs = StepGraphs(step, torch.device("cpu"), max_batch=4, max_blocks=8, widths=(2,), max_tokens=16, lazy=True)
    decode = build_batch([SeqChunk([5], 6, [3, 1], True), SeqChunk([7], 2, [2], True),
                          SeqChunk([9], 5, [4, 6], True)], BS)
    mixed = build_batch([SeqChunk([1, 2, 3, 4, 5], 0, [7, 8], True), SeqChunk([8], 6, [0, 1], True)], BS)
    assert not graphs.can_run(decode)
    graphs.capture()
    assert fake.CAPTURES == [16, (4, 8)]
    for batch, key in [(decode, (4, 2)), (decode, None), (mixed, 8), (mixed, None)]:
        before = list(fake.CAPTURES)
        assert graphs.can_run(batch)
        with torch.inference_mode():
            torch.testing.assert_close(graphs.run(batch)[0], step(batch)[0], rtol=0, atol=0)
        assert fake.CAPTURES == before + ([key] if key is not None else [])
    assert set(graphs.graphs) == {(4, 8), (4, 2)} and set(graphs.mixed) == {16, 8}


def test_capturing_all_takes_every_bucket_at_start_largest_first(fakes):
    fake, _ = fakes
    graphs = StepGraphs(lambda b: (b.input_ids[b.logits_indices],), torch.device("cpu"), max_batch=4, max_blocks=8,
                        widths=(2,), max_tokens=16)
    graphs.capture()
    assert fake.CAPTURES == [16, 8, (4, 8), (4, 2), (2, 8), (2, 2), (1, 8), (1, 2)]


def test_captures_leave_the_heap_frozen_as_they_found_it(fakes):
    """A server freezes what its start made (runtime/serve/server.py); a capture on first use
    mid-serving must not thaw it (gc.unfreeze thaws everything), nor leave a heap frozen that
    was not."""
    import gc

    graphs = StepGraphs(lambda b: (b.input_ids[b.logits_indices],), torch.device("cpu"), max_batch=4, max_blocks=8,
                        widths=(2,), max_tokens=16, lazy=True)
    gc.unfreeze()  # (a server started earlier in this process, as the suite's, froze its heap)
    graphs.capture()
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with torch.inference_mode():
            graphs.run(build_batch([SeqChunk([5], 6, [3, 1], True)], BS))
        # (not `>= frozen`: a frozen object whose last reference goes meanwhile leaves the count, as 2 did once in
        # the full suite; a thaw would leave none)
        assert len(graphs.graphs) == 2 and gc.get_freeze_count() > frozen // 2 > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_lazy_capture_emits_what_capturing_all_does_capturing_only_the_buckets_used(model, fakes, async_scheduling):
    """Greedy tokens of an engine that captures on first use equal capturing every bucket's and
    running eagerly; it captures the start's two buckets, then each bucket a step used, once,
    and nothing else; the run met several decode and mixed buckets (some at their first use)."""
    fake, log = fakes
    eager = greedy_run(model, enforce_eager=True, async_scheduling=async_scheduling)
    assert fake.CAPTURES == [] and log["replayed"] == []
    everything = greedy_run(model, cuda_graph_capture="all", async_scheduling=async_scheduling)
    assert len(fake.CAPTURES) == len(DECODE_SIZES) * len(WIDTHS) + len(TOKEN_BUCKETS)
    fake.CAPTURES.clear()
    log["replayed"].clear()
    log["captured"].clear()
    lazy = greedy_run(model, async_scheduling=async_scheduling)
    assert lazy == everything == eager
    used = list(dict.fromkeys(k for _, k in log["replayed"]))  # (in order of first use)
    assert fake.CAPTURES[:2] == START
    assert fake.CAPTURES[2:] == [key for key in used if key not in START]
    assert assert_captured_on_first_use(log) == len(fake.CAPTURES) - 2
    assert len({k for k in used if isinstance(k, tuple)}) >= 4 and len({k for k in used if isinstance(k, int)}) >= 2
    assert len(fake.CAPTURES) < len(DECODE_SIZES) * len(WIDTHS) + len(TOKEN_BUCKETS)


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_speculative_verification_and_draft_graphs_captured_on_first_use_emit_what_eager_does(model, fakes, method):
    """Verification steps (a few rows per sequence: mixed buckets below the batch size) and a
    draft model's passes (graphs of its own) replay graphs captured on first use: the tokens of
    no graphs and of every graph at start; each StepGraphs captures its start's buckets, then
    those it used."""
    _, log = fakes
    spec = {"num_speculative_tokens": 2, "adaptive": False}  # (timing-free)
    spec.update({"method": "ngram"} if method == "ngram" else {"model": "d"})
    draft = model if method == "draft-model" else None  # (the target itself: its drafts are accepted)
    eager = greedy_run(model, draft, enforce_eager=True, speculative_config=spec)
    everything = greedy_run(model, draft, cuda_graph_capture="all", speculative_config=spec)
    log["replayed"].clear()
    log["captured"].clear()
    assert greedy_run(model, draft, speculative_config=spec) == everything == eager
    assert len({id(g) for g, _ in log["captured"]}) == (2 if draft is not None else 1)
    assert any(isinstance(k, int) and k <= 8 for _, k in log["replayed"])  # (a verification bucket)
    assert assert_captured_on_first_use(log) > 0


def test_tensor_parallel_ranks_capture_the_buckets_rank_0_does_in_its_order(model, fakes, monkeypatch, tmp_path):
    """Two CPU ranks (gloo), each replaying emulated graphs of its shard with the all-reduces
    inside: rank 1 captures on first use the buckets rank 0 does, in the same order (their
    collectives meet), and the engine emits one process's tokens."""
    from runtime.executor import tensor_parallel

    fake, _ = fakes
    one = greedy_run(model, enforce_eager=True)
    monkeypatch.setattr(tensor_parallel, "RANK_MODULE", "tests.fake_cuda_graphs")
    monkeypatch.setenv("NANOINFER_TEST_CAPTURES", str(tmp_path))
    assert greedy_run(model, tensor_parallel_size=2) == one
    rank_1 = json.loads((tmp_path / "1").read_text())
    assert rank_1 == json.loads(json.dumps(fake.CAPTURES))
    assert fake.CAPTURES[:2] == START and len(fake.CAPTURES) > len(START)


def test_a_capture_mode_other_than_lazy_or_all_is_a_named_error():
    from runtime.async_engine import engine_config

    with pytest.raises(RequestError, match=r"cuda_graph_capture.*'eager'.*\['lazy', 'all'\]"):
        engine_config(cuda_graph_capture="eager")
