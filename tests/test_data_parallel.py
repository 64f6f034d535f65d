"""Data parallelism (issue 33, deliverable 5): replicas behind one front, requests routed by cached prefix, else
by load; outputs as one engine's, stats and /metrics per replica, a failed replica alone in its failure."""

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from nanoinfer import EngineError, RequestError, SamplingParams
from nanoinfer.errors import CheckpointError
from nanoinfer.loaders import LoadedModel
from runtime.async_engine import AsyncEngine, engine_config
from runtime.cli import parse_args
from runtime.engine_process.data_parallel import (DataParallelEngine, data_parallel_from_loaded, data_parallel_from_model,
                                     replica_devices)
from runtime.llm import LLM
from runtime.engine_process.router import Load, ReplicaRouter
from tests.live_server import LiveServer
from tests.tiny import random_params, tiny_config

CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
MODEL = LoadedModel(CFG, random_params(CFG, seed=11), None, Path("tiny-dp"))
BLOCK = 4
ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts(n, seed=0, length=(6, 20)):
    rng = random.Random(seed)
    return [[rng.randrange(1, CFG.vocab_size) for _ in range(rng.randint(*length))] for _ in range(n)]


def config(**kw):
    return engine_config(**{"block_size": BLOCK, "num_blocks": 128, **kw})


def dp_engine(_setup=None, **kw) -> DataParallelEngine:
    return data_parallel_from_loaded(MODEL, config(data_parallel_size=2, **kw), _setup=_setup)


IDLE = Load(0, 0)


# -- the router alone -----------------------------------------------------------------------------


def test_the_router_sends_a_cached_prefix_back_to_its_replica():
    router = ReplicaRouter([64, 64], BLOCK)
    shared = list(range(1, 13))  # three whole blocks
    first = router.route(shared + [50, 51], [IDLE, IDLE], [True, True])
    assert first == 0  # (a tie: the lowest index)
    # Replica 0 is now the busier one, yet the prefix brings the next prompt back to it.
    assert router.route(shared + [60, 61, 62], [Load(1, 14), IDLE], [True, True]) == 0
    # A prompt sharing no whole block goes by load.
    assert router.route([99] * 14, [Load(1, 14), IDLE], [True, True]) == 1
    # The longest recorded prefix wins: replica 1 holds four blocks of this one, replica 0 three.
    router.record(1, router.keys(shared + [30] * 8))
    longer = shared + [30] * 4 + [8, 9]
    assert [router.cached_blocks(i, router.keys(longer)) for i in (0, 1)] == [3, 4]
    assert router.route(longer, [IDLE, IDLE], [True, True]) == 1


def test_the_router_spreads_distinct_prompts_by_load_then_prompt_tokens():
    router = ReplicaRouter([64, 64, 64], BLOCK)
    healthy = [True] * 3
    assert router.route([1] * 9, [Load(2, 10), Load(1, 50), Load(1, 40)], healthy) == 2  # fewest requests, tokens
    assert router.route([2] * 9, [Load(1, 10), Load(1, 10), Load(1, 10)], healthy) == 0  # all equal: lowest index
    assert router.route([3] * 9, [IDLE, IDLE, IDLE], [False, True, True]) == 1  # an unhealthy replica takes nothing
    with pytest.raises(ValueError, match="no replica is healthy"):
        router.route([4] * 9, [IDLE] * 3, [False] * 3)


def test_a_prefix_does_not_pile_work_on_one_replica_beyond_the_slack():
    router = ReplicaRouter([64, 64], BLOCK, slack=2)
    system = list(range(1, 9))  # a prefix every prompt shares (a default system prompt)
    loads = [0, 0]
    picks = []
    for i in range(8):
        replica = router.route(system + [20 + i] * 3, [Load(n, 0) for n in loads], [True, True])
        loads[replica] += 1
        picks.append(replica)
    assert picks[:3] == [0, 0, 0] and picks[3] == 1  # the spill, after `slack` more than the other
    assert max(loads) - min(loads) <= 2  # then both hold the prefix, and load decides


def test_the_record_is_bounded_by_the_pool_and_drops_deep_blocks_first():
    router = ReplicaRouter([4, 4], BLOCK)
    long = list(range(1, 25))  # six blocks: more than the replica's pool of four
    router.record(0, router.keys(long))
    keys = router.keys(long)
    assert router.cached_blocks(0, keys) == 4  # the first four survive, the deepest two went
    assert not ReplicaRouter([4, 4], BLOCK, prefix_caching=False).keys(long)


def test_one_replica_takes_every_request_without_its_prompt_hashed(monkeypatch):
    """`serve --engine-process on` is one replica: nothing to choose, so no prefix keys (a burst of long
    prompts hashed block by block on the front's event loop was its largest cost per request)."""
    from runtime.engine_process import router as replica_router

    router = ReplicaRouter([64], BLOCK)
    monkeypatch.setattr(replica_router, "block_key", lambda *a: pytest.fail("a prompt hashed for one replica"))
    assert router.route(list(range(1, 40)), [Load(5, 100)], [True]) == 0
    with pytest.raises(ValueError, match="no replica is healthy"):
        router.route([4] * 9, [IDLE], [False])


# -- replicas over the tiny model ------------------------------------------------------------------


def test_replica_devices_follow_the_tensor_parallel_groups():
    assert replica_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3
    if torch.cuda.device_count() < 4:
        with pytest.raises(RequestError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs GPUs "
                                                r"cuda:0\.\.cuda:3"):
            replica_devices(torch.device("cuda", 0), 2, 2)


def test_greedy_outputs_at_dp2_equal_one_engines():
    batch = prompts(6)

    async def run(engine):
        async with engine:
            return [out.token_ids for out in await asyncio.gather(*(engine.generate(p, GREEDY) for p in batch))]
    one = asyncio.run(run(AsyncEngine(MODEL, config())))
    engine = dp_engine()
    two = asyncio.run(run(engine))
    assert two == one
    per = engine.stats()["replicas"]
    assert [s["generated_tokens"] > 0 for s in per] == [True, True]  # both replicas did work


def test_routing_stats_and_abort_on_the_engine():
    shared = list(range(1, 17))  # four whole blocks

    async def go():
        async with dp_engine() as engine:
            first = engine.submit(shared + [40, 41], GREEDY)
            await engine.collect(first)
            again = engine.submit(shared + [70, 71, 72], GREEDY)  # the same prefix: the same replica
            await engine.collect(again)
            distinct = [engine.submit(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in prompts(4, seed=5)]
            placed = [engine.replica_of(h) for h in [first, again, *distinct]]
            # Abort one long request by id: its replica ends it, the other replica's keep running.
            victim = distinct[0]
            victim_replica = engine.replica_of(victim)
            engine.abort(victim.request_id)
            aborted = await engine.collect(victim)
            others_running = [not h.finished for h in distinct[1:]]
            in_flight = [r.num_in_flight for r in engine.replicas]
            for handle in distinct[1:]:
                engine.abort(handle.request_id)
                await engine.collect(handle)
            for _ in range(500):  # (the workers report their last counts within a step)
                stats = engine.stats()
                if stats["running"] == stats["waiting"] == 0:
                    break
                await asyncio.sleep(0.01)
            return placed, aborted, victim_replica, others_running, in_flight, stats
    placed, aborted, victim_replica, others_running, in_flight, stats = asyncio.run(go())
    assert placed[0] == placed[1] == 0
    # Four distinct prompts arriving at once at idle replicas: spread by load, two each.
    assert sorted(placed[2:]) == [0, 0, 1, 1]
    assert aborted.outputs[0].finish_reason == "abort" and all(others_running)
    assert in_flight[victim_replica] == 1 and in_flight[1 - victim_replica] == 2
    assert len(stats["replicas"]) == 2 and stats["healthy"] is True
    for key in ("generated_tokens", "total_blocks", "free_blocks", "prefix_cache_hits"):
        assert stats[key] == sum(s[key] for s in stats["replicas"]), key
    assert stats["prefix_cache_hits"] == stats["replicas"][0]["prefix_cache_hits"] >= len(shared)


def test_shutdown_closes_every_replica():
    engine = dp_engine()

    async def go():
        async with engine:
            await engine.generate(prompts(1)[0], GREEDY)
        with pytest.raises(RuntimeError, match="not running"):
            engine.submit(prompts(1)[0], GREEDY)
    asyncio.run(go())
    assert [r.process.proc.returncode for r in engine.replicas] == [0, 0]  # (each closed its engine and left)


def break_replica_1(index, engine):
    """Run in each replica's process (data_parallel_from_loaded's `_setup`): replica 1's device "fails"."""
    def dead(batch):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    if index == 1:
        engine.core.executor._forward = dead


def test_a_failed_replica_loses_only_its_own_requests():
    batch = prompts(4, seed=9)

    async def undisturbed():
        async with AsyncEngine(MODEL, config()) as engine:
            return [out.token_ids for out in await asyncio.gather(*(engine.generate(p, GREEDY) for p in batch))]
    want = asyncio.run(undisturbed())

    engine = dp_engine(_setup="tests.test_data_parallel:break_replica_1")

    async def go():
        async with engine:
            handles = [engine.submit(p, GREEDY) for p in batch]
            placed = [engine.replica_of(h) for h in handles]
            results = await asyncio.gather(*(engine.collect(h) for h in handles), return_exceptions=True)
            healthy, stats = engine.healthy, engine.stats()
            after = engine.submit(batch[0], GREEDY)  # new work goes to the replica that serves
            return placed, results, healthy, stats, engine.replica_of(after), await engine.collect(after)
    placed, results, healthy, stats, after_replica, after = asyncio.run(go())
    assert sorted(placed) == [0, 0, 1, 1]
    for replica, got, expected in zip(placed, results, want):
        if replica == 0:
            assert got.token_ids == expected
        else:
            assert isinstance(got, EngineError) and "illegal memory access" in str(got)
    assert healthy and [s["healthy"] for s in stats["replicas"]] == [True, False]
    assert after_replica == 0 and after.token_ids == want[0]


def test_offline_and_misuse_are_refused_by_name():
    with pytest.raises(RequestError, match="data_parallel_size=2 is a server setting"):
        LLM.from_loaded(MODEL, data_parallel_size=2)
    with pytest.raises(RequestError, match="data_parallel_size=0 is invalid"):
        config(data_parallel_size=0)
    assert parse_args(["serve", "--data-parallel-size", "2"]).data_parallel_size == 2


@pytest.mark.slow
def test_each_replica_runs_its_own_tensor_parallel_group():
    """DP=2 x TP=2 on CPU ranks: each replica's process is its group's rank 0 (its own default process group)."""
    batch = prompts(4, seed=3)

    async def run(engine):
        async with engine:
            return [out.token_ids for out in await asyncio.gather(*(engine.generate(p, GREEDY) for p in batch))]
    one = asyncio.run(run(AsyncEngine(MODEL, config())))
    engine = dp_engine(tensor_parallel_size=2)
    assert asyncio.run(run(engine)) == one
    assert [s["generated_tokens"] > 0 for s in engine.stats()["replicas"]] == [True, True]


# -- behind the server -----------------------------------------------------------------------------


def test_the_server_labels_each_replicas_metrics(tiny_chat_model):
    with LiveServer(tiny_chat_model, engine_kw={"data_parallel_size": 2}) as server:
        engine = server.engine
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

        async def two_at_once():  # (queued in one go: the router sees both replicas idle, then one busy)
            handles = [engine.submit(f"Story number {i}: once upon a time", params) for i in range(2)]
            return [engine.replica_of(h) for h in handles], [len((await engine.collect(h)).token_ids)
                                                              for h in handles]
        placed, lengths = server.call(two_at_once())
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 6,
                                                                    "temperature": 0, "ignore_eos": True}, timeout=60)
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        health = httpx.get(server.url + "/health").json()
        text = httpx.get(server.url + "/metrics").text
    assert placed == [0, 1] and lengths == [6, 6]
    assert answer.status_code == chat.status_code == 200 and health == {"status": "ok"}
    tokens = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("nanoinfer_generated_tokens_total{")}
    assert set(tokens) == {'nanoinfer_generated_tokens_total{replica="0"}',
                           'nanoinfer_generated_tokens_total{replica="1"}'}
    assert sum(tokens.values()) == 24 and min(tokens.values()) >= 6  # both replicas served
    assert 'nanoinfer_healthy{replica="0"} 1.0' in text and 'nanoinfer_healthy{replica="1"} 1.0' in text
    assert "nanoinfer_generated_tokens_total 24.0" not in text  # per replica only: sum() them in queries


# -- replicas as processes -------------------------------------------------------------------------


def slow_replica_1(index, engine):
    """(`_setup`) Replica 1's steps take 50 ms: its requests are surely running when the test kills it."""
    if index == 1:
        forward = engine.core.executor._forward
        engine.core.executor._forward = lambda batch: (time.sleep(0.05), forward(batch))[1]


def descendants(pid: int) -> set[int]:
    """The live processes below `pid` (from /proc), but multiprocessing's resource tracker: an
    earlier test of this process that made shared memory or a spawn context's queue started it,
    and it lives as long as the process (by multiprocessing's design, not an engine's leak)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if b"multiprocessing.resource_tracker" in (stat.parent / "cmdline").read_bytes():
                continue
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def test_a_killed_replica_fails_its_own_requests_and_the_other_serves_on():
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    batch = prompts(4, seed=21)
    engine = dp_engine(_setup="tests.test_data_parallel:slow_replica_1")
    victim = engine.replicas[1].process.proc

    async def go():
        async with engine:
            handles = [engine.submit(p, long) for p in batch]
            placed = [engine.replica_of(h) for h in handles]
            while engine.stats()["replicas"][1]["generated_tokens"] == 0:  # (running there)
                await asyncio.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*(engine.collect(h) for h in handles), return_exceptions=True)
            failed_after = time.monotonic() - killed
            healthy, stats = engine.healthy, engine.stats()
            after = engine.submit(batch[0], GREEDY)  # new work goes to the live replica
            return placed, results, failed_after, healthy, stats, engine.replica_of(after), await engine.collect(after)
    placed, results, failed_after, healthy, stats, after_replica, after = asyncio.run(go())
    assert sorted(placed) == [0, 0, 1, 1]
    for replica, got in zip(placed, results):
        if replica == 0:
            assert len(got.token_ids) == 200 and got.finish_reason == "length"
        else:
            assert isinstance(got, EngineError)
            assert "data-parallel replica 1 exited (code -9, SIGKILL): its requests failed" in str(got)
    assert failed_after < 10  # (the bound; its socket closes as it dies)
    assert healthy and [s["healthy"] for s in stats["replicas"]] == [True, False]
    assert "SIGKILL" in stats["replicas"][1]["error"]
    assert after_replica == 0 and len(after.token_ids) == GREEDY.max_tokens
    assert [r.process.proc.returncode for r in engine.replicas] == [0, -9] and not descendants(os.getpid())


def slow_replicas(index, engine):
    """(`_setup`) Every replica's steps take 50 ms: its requests are surely running when the test kills it."""
    forward = engine.core.executor._forward
    engine.core.executor._forward = lambda batch: (time.sleep(0.05), forward(batch))[1]


def test_the_last_replica_lost_says_that_none_serves_on():
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    engine = dp_engine(_setup="tests.test_data_parallel:slow_replicas")

    async def go():
        async with engine:
            handles = [engine.submit(p, long) for p in prompts(2, seed=5, length=(30, 40))]
            by_replica = {engine.replica_of(h): h for h in handles}
            while not all(s["generated_tokens"] for s in engine.stats()["replicas"]):  # (both running)
                await asyncio.sleep(0.01)
            errors = []
            for index in (1, 0):  # one, then the other
                os.kill(engine.replicas[index].process.pid, signal.SIGKILL)
                errors.append(await asyncio.gather(engine.collect(by_replica[index]), return_exceptions=True))
            return [e[0] for e in errors], engine.healthy
    (first, last), healthy = asyncio.run(go())
    assert isinstance(first, EngineError) and "replica 1 exited" in str(first) and "replica 0 serves on" in str(first)
    assert isinstance(last, EngineError) and "replica 0 exited" in str(last)
    assert "no replica is left" in str(last) and "serves on" not in str(last)
    assert not healthy


@pytest.mark.slow
def test_shutdown_stops_every_process_of_every_replica_in_time():
    engine = dp_engine(tensor_parallel_size=2)  # (each replica has a rank process of its own)

    async def go():
        async with engine:
            handles = [engine.submit(p, SamplingParams(max_tokens=300, ignore_eos=True)) for p in prompts(2)]
            while engine.stats()["generated_tokens"] == 0:
                await asyncio.sleep(0.01)
            started = descendants(os.getpid())
            began = time.monotonic()
        return handles, started, time.monotonic() - began
    handles, started, took = asyncio.run(go())
    assert len(started) >= 4  # two replicas, a rank each
    assert took < 10 and all(h.finished for h in handles)
    assert not descendants(os.getpid())


SCRIPT = """
import asyncio
from pathlib import Path

from nanoinfer import SamplingParams
from nanoinfer.loaders import LoadedModel
from runtime.async_engine import engine_config
from runtime.engine_process.data_parallel import data_parallel_from_loaded
from tests.tiny import random_params, tiny_config

cfg = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
model = LoadedModel(cfg, random_params(cfg, seed=11), None, Path("tiny-dp"))


async def run():
    config = engine_config(block_size=4, num_blocks=64, data_parallel_size=2)
    async with data_parallel_from_loaded(model, config) as engine:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        handles = [engine.submit([3, 1, 4, 1, 5, 9, 2, 6][i:], params) for i in range(2)]
        outs = [await engine.collect(h) for h in handles]
        print("OUT", sorted(engine.replica_of(h) for h in handles), [len(o.token_ids) for o in outs])

asyncio.run(run())
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stdin", "script without a main guard"])
def test_replicas_start_from_any_program(how, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if how == "stdin":
        done = subprocess.run([sys.executable, "-"], input=SCRIPT, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env=env)
    else:
        (tmp_path / "no_guard.py").write_text(SCRIPT)
        done = subprocess.run([sys.executable, "no_guard.py"], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OUT [0, 1] [5, 5]" in done.stdout


def test_structured_output_compiles_in_the_replicas(tiny_chat_model):
    engine = data_parallel_from_loaded(tiny_chat_model, engine_config(block_size=16, num_blocks=256,
                                                                      data_parallel_size=2))
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})

    async def go():
        async with engine:
            with pytest.raises(RequestError, match="cannot constrain generation") as bad:
                engine.submit("Pick one", SamplingParams(max_tokens=8, structured_outputs={"regex": r"[^\s\S]"}))
            handles = [engine.submit(f"Pick one, {i}", choice) for i in range(2)]
            return bad.value, sorted(engine.replica_of(h) for h in handles), [
                (await engine.collect(h)).text for h in handles]
    bad, placed, texts = asyncio.run(go())
    assert bad.param == "structured_outputs" and placed == [0, 1]
    assert all(t in ("yes", "no") for t in texts)


def test_a_replica_that_fails_to_start_raises_its_error(capfd):
    missing = Path("/nonexistent/model")
    with pytest.raises(CheckpointError, match=f"{missing}: not found"):  # (as one engine's load raises it)
        data_parallel_from_model(str(missing), data_parallel_size=2, device="cpu")
    assert not descendants(os.getpid())  # (the other replica stopped too)
    out, err = capfd.readouterr()  # (a replica's output is echoed, "[dp replica N] ..."): the error is raised
    assert "Traceback" not in out + err and "dp replica" not in out + err  # once, by the front, not N times


@pytest.mark.slow
def test_serve_on_a_bad_model_file_says_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--model", str(bad), "--device", "cpu",
                           "--data-parallel-size", "2", "--port", "0"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "GGUF" in lines[0], lines[:12]


def die_in_replica_1(index, engine):
    """(`_setup`) Replica 1's process ends before it serves, as a crash (no Python error to send)."""
    if index == 1:
        print("replica 1 is going down", flush=True)
        os._exit(3)


def test_a_replica_that_dies_at_start_is_named_with_its_exit_code_and_output():
    with pytest.raises(EngineError, match=r"data-parallel replica 1 exited while starting \(code 3\)") as failed:
        dp_engine(_setup="tests.test_data_parallel:die_in_replica_1")
    assert "replica 1 is going down" in str(failed.value)
    assert not descendants(os.getpid())


@pytest.mark.slow
def test_replicas_exit_when_their_front_is_killed(tmp_path):
    script = SCRIPT.replace("asyncio.run(run())", """engine = data_parallel_from_loaded(model, engine_config(block_size=4, num_blocks=64,
                                                                data_parallel_size=2))
print("PIDS", *(r.process.pid for r in engine.replicas), flush=True)
import time
time.sleep(300)
""")
    front = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    front.stdin.write(script)
    front.stdin.close()
    line = front.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    front.kill()
    front.wait()
    deadline = time.monotonic() + 10  # (a replica polls its parent every half second)
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
