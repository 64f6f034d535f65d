"""Pipeline parallelism over CPU ranks (gloo): the engine with its layers in stages over
processes (runtime/executor/pipeline_parallel.py), alone and with tensor parallelism inside
each stage, emits one rank's greedy tokens, through forks, preemption and prompt logprobs; from
a script without a main guard and from stdin; a stage's rank that dies at start, mid-step or
at close is reported naming it within 10 s, close returns within 10 s and nothing is left;
what cannot run in stages is a named error before any rank starts."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams
from tests.test_tensor_parallel import engine_outputs, running
from tests.test_tp_ranks import (  # noqa: F401 - (a fixture)
    BOUND,
    assert_gone,
    failing_rank,
    run_user_script,
    user_script,
)
from tests.test_tp_ranks import greedy as tp_greedy
from tests.tiny import random_params, tiny_config

ROOT = Path(__file__).parent.parent
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9] * 11, [10, 11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def staged_model():
    """Four layers (three stages of 2 + 1 + 1); 9 query heads over 3 KV heads (TP=2: 3 + 6)."""
    from nanoinfer.loaders import LoadedModel

    cfg = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=72, num_layers=4)
    return LoadedModel(cfg, random_params(cfg, seed=3), None, Path("tiny"))


@pytest.fixture(scope="module")
def model():
    return staged_model()


@pytest.mark.parametrize("sizes", [dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=3),
                                   dict(pipeline_parallel_size=2, tensor_parallel_size=2),
                                   dict(pipeline_parallel_size=2, pipeline_micro_batches=8),
                                   dict(pipeline_parallel_size=2, async_scheduling=True)],
                         ids=["pp2", "pp3", "tp2xpp2", "pp2-8-micro-batches", "pp2-two-steps-in-flight"])
def test_stages_emit_what_one_rank_does(model, sizes):
    """Forks sharing blocks (n=2, copy-on-write copies on every stage) and top-k sampling by seed."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2, seed=1, top_k=2)
    one, _ = engine_outputs(model, PROMPTS, params, block_size=4, num_blocks=64)
    staged, _ = engine_outputs(model, PROMPTS, params, block_size=4, num_blocks=64, **sizes)
    assert staged == one


def test_stages_replaying_graphs_emit_what_one_rank_does(model, monkeypatch, tmp_path):
    """Each stage's CUDA graphs (one per padded micro-batch size: the first stage's of tokens,
    a middle one's and the last one's of the activations they receive), emulated on the CPU
    (tests/fake_cuda_graphs.py), with the sends and receives between replays: one rank's
    tokens, through forks, and every rank replays; each captures on first use (nanoinfer/backends/cuda/graphs.py)
    the buckets of the same micro-batches, in the same order."""
    import json

    from runtime.executor import tensor_parallel
    from tests import fake_cuda_graphs

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2, seed=1, top_k=2)
    small = dict(block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    one, _ = engine_outputs(model, PROMPTS, params, **small)
    fake_cuda_graphs.install(monkeypatch.setattr)
    monkeypatch.setattr(fake_cuda_graphs, "REPLAYS", [0])
    monkeypatch.setattr(tensor_parallel, "RANK_MODULE", "tests.fake_cuda_graphs")
    monkeypatch.setattr(fake_cuda_graphs, "CAPTURES", [])
    monkeypatch.setenv("NANOINFER_TEST_REPLAYS", str(tmp_path / "replays"))
    monkeypatch.setenv("NANOINFER_TEST_CAPTURES", str(tmp_path / "captures"))
    (tmp_path / "replays").mkdir()
    (tmp_path / "captures").mkdir()
    staged, _ = engine_outputs(model, PROMPTS, params, pipeline_parallel_size=3, **small)
    assert staged == one
    replays = {p.name: int(p.read_text()) for p in (tmp_path / "replays").iterdir()}
    assert replays.keys() == {"1", "2"} and min(replays.values()) > 0 and fake_cuda_graphs.REPLAYS[0] > 0
    captures = [json.loads(json.dumps(fake_cuda_graphs.CAPTURES))]
    captures += [json.loads((tmp_path / "captures" / rank).read_text()) for rank in ("1", "2")]
    # (at start the largest mixed and decode buckets, then those the steps used; a decode bucket's block
    # tables are as wide as the longest sequence the pool holds: 64 blocks of 4)
    assert captures[0][:2] == [32, [8, 64]] and len(captures[0]) > 2 and captures[1] == captures[2] == captures[0]


def test_a_stages_graphs_replay_its_forward_and_write_only_the_batch_slots(model, monkeypatch):
    """Each stage's graphs (emulated: tests/fake_cuda_graphs.py) against its eager forward, over
    a decode batch (3 sequences padded to 4) and a mixed one (10 tokens padded to 16): the same
    activations and logits, and the KV pools (random, so a stray write shows) written at the
    batch's slots alike and nowhere else, padding rows included."""
    import torch

    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.backends.cuda.graphs import GraphSizes
    from nanoinfer.model.kv_cache import allocate_kv_pool
    from nanoinfer.model.decoder import forward
    from nanoinfer.parallel.pipeline import Stage, stage_config, stage_params
    from runtime.executor import tp_follower
    from runtime.executor.pp_stages import capture_stage, graph_or_eager
    from tests import fake_cuda_graphs

    fake_cuda_graphs.install(monkeypatch.setattr)
    cfg, bs = model.config, 4
    batches = [build_batch([SeqChunk([5], 6, [0, 1], True), SeqChunk([7], 2, [2], True),
                            SeqChunk([9], 12, [3, 4, 5, 6], True)], bs),
               build_batch([SeqChunk([1, 2, 3, 4, 5, 6, 7], 0, [8, 9], True), SeqChunk([8], 6, [0, 1], True),
                            SeqChunk([3, 4], 2, [2], True)], bs)]
    sizes = GraphSizes(max_batch=4, max_blocks=8, widths=(2,), max_tokens=16)
    hidden = {}  # each batch's activations into the last stage (the eager ones)
    for index in range(2):
        stage = Stage(index, 2)
        local, part = stage_config(cfg, stage), stage_params(model.params, cfg, stage)
        kernels = tp_follower.kernels_for(local, torch.device("cpu"), bs)  # (the fake's: graphs claimed)
        start = allocate_kv_pool(local, 16, bs, torch.float32, "cpu")
        start.normal_(generator=torch.Generator().manual_seed(1))
        pools = {"eager": start.clone(), "graphs": start.clone()}

        def step(kv):
            return lambda batch, h: forward(part, kv, batch, local, kernels.attention, kernels.layer_fns,
                                            logits_dtype=None, hidden=h)

        graphs = capture_stage(step(pools["graphs"]), stage, sizes, cfg.hidden_size, torch.float32, torch.device("cpu"))
        compute = graph_or_eager(step(pools["graphs"]), graphs)
        for i, batch in enumerate(batches):
            assert graphs.can_run(batch)
            h = hidden.get(i)
            with torch.inference_mode():  # (as the engine and the ranks run steps)
                eager, replayed = step(pools["eager"])(batch, h), compute(batch, h)
            assert replayed.shape == eager.shape == ((batch.num_tokens, cfg.hidden_size) if index == 0 else
                                                    (batch.num_seqs, cfg.vocab_size))
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
            hidden[i] = eager
            torch.testing.assert_close(pools["graphs"], pools["eager"], rtol=1e-5, atol=1e-5)
        written = torch.zeros(16 * bs, dtype=torch.bool)
        written[torch.cat([b.slot_mapping for b in batches])] = True
        flat = {k: v.view(*v.shape[:2], 16 * bs, -1) for k, v in pools.items()}
        assert torch.equal(flat["graphs"][:, :, ~written], start.view_as(flat["graphs"])[:, :, ~written])
    assert fake_cuda_graphs.REPLAYS[0] >= 4


def test_stages_follow_preemption_by_swap(model):
    """A pool too small for the batch: every stage swaps its own layers' blocks out and in."""
    config = dict(block_size=4, num_blocks=12, preemption_mode="swap", swap_space=1 << 20)
    one, stats_one = engine_outputs(model, PROMPTS, GREEDY, **config)
    two, stats_two = engine_outputs(model, PROMPTS, GREEDY, pipeline_parallel_size=2, **config)
    assert two == one and stats_two["num_preemptions"] == stats_one["num_preemptions"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_two_steps_in_flight_over_stages_emit_what_one_rank_does(model, preemption_mode):
    """Async scheduling over two stages keeps two steps of disjoint sequences in flight
    (runtime/engine/virtual_engines.py): many sequences of different lengths and limits (some
    finish while the other group's step is in flight), chunked prefills, forks, and a pool
    small enough to preempt; and a single request (its group runs every step)."""
    prompts = [[(5 * i + j) % 60 + 3 for j in range(2 + 3 * i)] for i in range(10)]
    limits = [SamplingParams(temperature=0, max_tokens=3 + 2 * (i % 5), ignore_eos=True, n=1 + (i % 3 == 0))
              for i in range(len(prompts))]
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    config = dict(block_size=4, num_blocks=24, max_num_batched_tokens=16, preemption_mode=preemption_mode,
                  swap_space=1 << 20)
    for prompt_set, params in ((prompts, limits), (PROMPTS[:1], [GREEDY])):
        runs = []
        for size in (1, 2):
            core = EngineCore(model, engine_config(pipeline_parallel_size=size, async_scheduling=size == 2, **config))
            try:
                assert core.steps_in_flight == (2 if size == 2 else 0)
                seqs = []  # every completion (forks included)
                for p, sp in zip(prompt_set, params):
                    seqs += core.scheduler.requests[core.add_request(p, sp).request]
                while core.has_unfinished():
                    core.step()
                runs.append(([seq.output_token_ids for seq in seqs], core.scheduler.num_preemptions))
            finally:
                core.close()
        assert runs[1][0] == runs[0][0]
        if len(prompt_set) > 1:
            assert runs[1][1] > 0 and runs[0][1] > 0


def test_pipeline_overlap_off_keeps_one_step_in_flight(model):
    """`pipeline_overlap=False` (for a small model whose step rank 0's host bounds): async
    scheduling over the stages with one step in flight, one rank's tokens."""
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    one, _ = engine_outputs(model, PROMPTS[:3], GREEDY)
    core = EngineCore(model, engine_config(pipeline_parallel_size=2, async_scheduling=True, pipeline_overlap=False))
    try:
        assert core.steps_in_flight == 1 and core.scheduler.lanes is None
        seqs = [core.add_request(p, GREEDY) for p in PROMPTS[:3]]
        while core.has_unfinished():
            core.step()
        assert [seq.output_token_ids for seq in seqs] == [tokens for _, tokens in one]
    finally:
        core.close()


def test_prompt_logprobs_come_back_in_order(model):
    """Prompt logprobs ask for many logits rows of one sequence: the micro-batches' logits are
    put back in the step's order (the same tokens and logprobs as one rank, to fp32 rounding)."""
    from runtime.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    runs = []
    for size in (1, 2):
        with LLM.from_loaded(model, num_blocks=64, block_size=4, pipeline_parallel_size=size) as llm:
            runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
    for one, two in zip(*runs):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        first, second = one.prompt_logprobs, two.prompt_logprobs
        assert len(first) == len(second) == len(one.prompt_token_ids) and first[0] is None is second[0]
        for a, b in zip(first[1:], second[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.slow
def test_default_model_in_two_stages_writes_one_ranks_text(smollm2_gguf):
    """The offline facade, SmolLM2-135M's 30 layers as 15 + 15, in fp32: one rank's greedy text."""
    from nanoinfer import LLM

    prompts = ["The capital of France is", "def fibonacci(n):"]
    texts = []
    for size in (1, 2):
        with LLM(smollm2_gguf, device="cpu", dtype="float32", progress=False, num_blocks=64,
                 pipeline_parallel_size=size) as llm:
            texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert texts[0] == texts[1]


# -- from the user's program; ranks that die ------------------------------------------------------

SCRIPT = user_script("from tests.test_pipeline_parallel import staged_model as model",
                     "num_blocks=32, block_size=4, pipeline_parallel_size=2", PROMPTS, GREEDY.max_tokens)


def engine(**config):
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    return EngineCore(staged_model(), engine_config(num_blocks=32, block_size=4, **{"pipeline_parallel_size": 2,
                                                                                     **config}))


def greedy(core) -> list[list[int]]:
    return tp_greedy(core, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def one_rank(model):
    core = engine(pipeline_parallel_size=1)
    try:
        return greedy(core)
    finally:
        core.close()


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_stages_do_not_run_the_users_program(tmp_path, how, one_rank):
    result = run_user_script(SCRIPT, how, tmp_path)
    assert result["tokens"] == one_rank
    assert len(result["ranks"]) == 1 and not any(running(pid) for pid in result["ranks"])


@pytest.mark.parametrize("where, code, tail", [
    ("start", 1, "RuntimeError: test rank fails at start"),
    ("setup", 1, "RuntimeError: test rank fails at setup"),
])
def test_a_stage_that_dies_starting_fails_the_start(failing_rank, where, code, tail):  # noqa: F811
    from runtime.executor.tp_processes import RankLost

    started = failing_rank(where)
    begun = time.monotonic()
    with pytest.raises(RankLost) as lost:
        engine()
    assert time.monotonic() - begun < BOUND
    assert str(lost.value).startswith(f"tensor-parallel rank 1 exited while starting (code {code})") or \
        str(lost.value).startswith(f"tensor-parallel rank 1 exited (code {code})")
    assert tail in str(lost.value)
    assert_gone(started)


def test_a_stage_that_fails_mid_step_fails_the_step(failing_rank):  # noqa: F811
    """The last stage raises in its third forward while rank 0 waits for its logits."""
    from runtime.engine.faults import EngineDead

    started = failing_rank("step")
    core = engine()
    try:
        begun = time.monotonic()
        with pytest.raises(EngineDead) as dead:
            greedy(core)
        assert time.monotonic() - begun < BOUND + 5  # (two steps' work, then the report)
        assert "tensor-parallel rank 1 exited (code 1)" in str(dead.value)
        assert "RuntimeError: test rank fails at step" in str(dead.value)
    finally:
        begun = time.monotonic()
        core.close()
        assert time.monotonic() - begun < BOUND
    assert_gone(started)


def test_a_stage_killed_between_steps_fails_the_next(failing_rank):  # noqa: F811
    from runtime.engine.faults import EngineDead

    started = failing_rank("idle")
    core = engine()
    try:
        greedy(core)
        rank1 = core.executor.tp.procs[0]
        rank1.send_signal(signal.SIGKILL)
        rank1.wait(BOUND)
        begun = time.monotonic()
        with pytest.raises(EngineDead, match=r"tensor-parallel rank 1 exited \(code -9, SIGKILL\)"):
            greedy(core)
        assert time.monotonic() - begun < BOUND
    finally:
        begun = time.monotonic()
        core.close()
        assert time.monotonic() - begun < BOUND
    assert_gone(started)


def test_a_stage_that_fails_at_close_is_reported_and_close_returns(failing_rank, caplog, one_rank):  # noqa: F811
    started = failing_rank("close")
    core = engine()
    assert greedy(core) == one_rank
    begun = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="nanoinfer.tensor_parallel"):
        core.close()
    assert time.monotonic() - begun < BOUND
    (report,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    # (code 1, or SIGABRT where the groups it failed to leave tear down at its exit: a stage has more of them)
    assert report.startswith(("tensor-parallel rank 1 exited before the engine closed (code 1)",
                              "tensor-parallel rank 1 exited before the engine closed (code -6, SIGABRT)"))
    assert "RuntimeError: test rank fails at close" in report
    assert_gone(started)


# -- what cannot run in stages ---------------------------------------------------------------------

def test_what_cannot_run_in_stages_is_named_before_any_rank_starts(model, tmp_path, monkeypatch):
    from runtime.executor import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "RankProcesses", None)  # (a rank started would fail the test)
    with pytest.raises(RequestError, match=r"pipeline_parallel_size=5 for a model of 4 layers: expected 1 to 4"):
        engine(pipeline_parallel_size=5)
    with pytest.raises(RequestError, match="pipeline_parallel_size=0 is invalid"):
        engine(pipeline_parallel_size=0)
    with pytest.raises(RequestError, match=r"pipeline_parallel_size=2 with speculative_config: .* expected "
                                           r"pipeline_parallel_size=1"):
        engine(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    from nanoinfer.loaders import load_model
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore
    from tests.nanochat_files import nanochat_state, write_checkpoint

    write_checkpoint(tmp_path / "d4", nanochat_state())
    nanochat = load_model(tmp_path / "d4", device="cpu", progress=False)
    with pytest.raises(RequestError, match="a nanochat model runs whole"):
        EngineCore(nanochat, engine_config(num_blocks=16, pipeline_parallel_size=2))
    from runtime.engine_process.data_parallel import data_parallel_from_loaded

    with pytest.raises(RequestError, match="data_parallel_size=2 with pipeline_parallel_size=2 is not supported"):
        data_parallel_from_loaded(model, engine_config(data_parallel_size=2, pipeline_parallel_size=2))


def test_the_flag_is_checked_on_the_command_line(capsys):
    from runtime.cli import main

    assert main(["generate", "hi", "--device", "cpu", "--pipeline-parallel-size", "0"]) == 2
    assert "pipeline_parallel_size=0" in capsys.readouterr().err


def test_the_default_path_runs_no_pipeline_code():
    """One rank: neither the stages' module nor the split is imported."""
    code = ("import sys; from pathlib import Path; from tests.tiny import random_params, tiny_config; "
            "from nanoinfer.loaders import LoadedModel; from runtime.llm import LLM; "
            "from nanoinfer.sampling.sampler import SamplingParams; cfg = tiny_config(num_layers=4); "
            "llm = LLM.from_loaded(LoadedModel(cfg, random_params(cfg), None, Path('tiny')), num_blocks=16, "
            "block_size=4); "
            "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False); "
            "print(sorted(m for m in sys.modules if any(w in m for w in ('pipeline', 'tensor_parallel', 'parallel.shards', "
            "'.tp_', '.pp_'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"


def _order_rank(rank: int, init_file: str, results, transport: str, ring) -> None:
    """Rank 0 sends two forwards, one with its Cut; rank 1 receives them as a stage rank does, over
    `transport`: "channel" (in `ring`, a shared tensor: the ranks the engine starts), "named"
    (torchrun's ranks on one host: a ring rank 0 names) or "group" (the control group)."""
    import torch
    import torch.distributed as dist

    from nanoinfer.model.batch import SeqChunk, build_batch
    from runtime.executor.control_channel import ChannelReader, ChannelWriter
    from runtime.executor.tensor_parallel import TensorParallelRanks
    from runtime.executor.tp_follower import _receive
    from runtime.executor.tp_groups import SLOT_SIZE, SLOTS, named_channel
    from runtime.executor.tp_orders import Cut

    os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2" if transport == "named" else "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        control = dist.new_group(backend="gloo")
        channel = named_channel(control, rank, 2)
        assert (channel is not None) == (transport == "named")
        if transport == "channel":
            channel = ChannelWriter(ring.numpy(), SLOTS, SLOT_SIZE, 1) if rank == 0 else ChannelReader(ring.numpy(), 0)
        batch = build_batch([SeqChunk([5, 6, 7], 0, [0], True), SeqChunk([8], 4, [1, 2], True)], 4)
        if rank == 0:
            ranks = TensorParallelRanks.__new__(TensorParallelRanks)  # (only what forward() needs)
            ranks.control, ranks.check_ranks, ranks.channel = control, lambda: None, channel
            ranks.watching = lambda: __import__("contextlib").nullcontext()
            ranks.forward(batch, Cut([0, 3, 4], [2, 3]))
            ranks.forward(batch)
        else:
            got = [_receive(torch.device("cpu"), control, channel) for _ in range(2)]
            results.put([(kind, [t.tolist() for t in b], c) for kind, (b, c) in got]
                        + [[t.tolist() for t in batch]])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["channel", "named", "group"])
def test_a_stage_rank_takes_the_cut_from_rank_0(tmp_path, transport):
    """Stage ranks cut the step into micro-batches from rank 0's host layout (the Cut sent with the
    forward), never from their GPU copies of the batch, whose reading waited for the step before:
    the batch arrives whole, with the Cut where rank 0 sent one and None where it did not. Over
    the control channel (the ranks the engine starts; torchrun's on one host, whose ring leaves
    nothing in /dev/shm) and the control group (torchrun's over hosts) alike."""
    import multiprocessing

    import torch

    from runtime.executor.control_channel import ChannelWriter, channel_bytes
    from runtime.executor.tp_groups import SLOT_SIZE, SLOTS

    ring = None
    if transport == "channel":  # (its layout written before either rank starts)
        ring = torch.zeros(channel_bytes(SLOTS, SLOT_SIZE, 1), dtype=torch.uint8).share_memory_()
        ChannelWriter(ring.numpy(), SLOTS, SLOT_SIZE, 1)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_order_rank, args=(r, str(tmp_path / "rendezvous"), results, transport, ring))
             for r in range(2)]
    for p in ranks:
        p.start()
    (kind, batch, cut), (kind2, batch2, cut2), sent = results.get(timeout=60)
    for p in ranks:
        p.join(30)
        assert p.exitcode == 0
    assert kind == kind2 == "forward" and batch == batch2 == sent
    assert cut == ([0, 3, 4], [2, 3]) and cut2 is None
    assert not any(name.startswith(f"nanoinfer-control-{ranks[0].pid}-") for name in os.listdir("/dev/shm"))


def test_the_profiling_step_samples_on_the_first_stage(monkeypatch):
    """What sizes rank 0's KV pool on a GPU (kv_budget.run_peak_step) runs rank 0's part of the
    model: under pipeline parallelism the first stage, which has no LM head. Rank 0 still
    receives the last stage's logits and samples them, so the profile must take the sampler's
    peak ([rows, vocab] tables, top-k/top-p sort) too; it stopped after the stage's layers, and
    the pool it sized left no room for the first big sampled step."""
    from nanoinfer.attention.reference import REFERENCE
    from nanoinfer.loaders import LoadedModel
    from nanoinfer.parallel.pipeline import Stage, stage_config, stage_params
    from runtime.async_engine import engine_config
    from runtime.executor import kv_budget

    cfg = tiny_config(num_layers=4)
    params = random_params(cfg, seed=3)
    first = LoadedModel(stage_config(cfg, Stage(0, 2)), stage_params(params, cfg, Stage(0, 2)), None, Path("tiny"))
    sampled = []
    real = kv_budget.sample
    monkeypatch.setattr(kv_budget, "sample", lambda logits, st: sampled.append(logits.shape) or real(logits, st))
    kv_budget.run_peak_step(first, engine_config(max_num_batched_tokens=64, max_num_seqs=8), REFERENCE)
    assert sampled == [(8, cfg.vocab_size)]
