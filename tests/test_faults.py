"""Fault isolation: a failure inside a step fails only the request it belongs to, a transient one
fails nobody, running out of memory shrinks the step, and only a dead device makes the engine
unhealthy. Faults are injected into the real step loop (AsyncEngine over the tiny model); every
request the fault does not belong to must finish with exactly the tokens it gets undisturbed."""

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest
import torch

import runtime.engine.engine_core as engine_core
import runtime.executor.kv_pools as kv_pools
from runtime.executor.input_batch import InputBatch
from nanoinfer import EngineError, RequestError, SamplingParams
from nanoinfer.loaders import LoadedModel
from runtime.async_engine import AsyncEngine, engine_config
from tests.tiny import patch_forward, random_params, tiny_config

CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
POISON = 5  # a token id whose embedding is NaN in the poisoned model


def poisoned_model() -> LoadedModel:
    params = random_params(CFG, seed=3)
    embed = params.embed.clone()
    embed[POISON] = float("nan")
    return LoadedModel(CFG, dataclasses.replace(params, embed=embed), None, Path("tiny-poisoned"))


MODEL = poisoned_model()


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.choice([t for t in range(CFG.vocab_size) if t != POISON]) for _ in range(rng.randint(3, 30))]
            for _ in range(n)]


PROMPTS = prompts(8)


def params(seed):
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True)


def make_engine(**kw) -> AsyncEngine:
    return AsyncEngine(MODEL, engine_config(**{"block_size": 4, "num_blocks": 256, **kw}))


async def run_all(engine, requests):
    """requests: (prompt, params); results or exceptions, in order."""
    return await asyncio.gather(*(engine.generate(p, sp) for p, sp in requests), return_exceptions=True)


async def idle_stats(engine):
    for _ in range(500):
        s = engine.stats()
        if s["running"] == s["waiting"] == s["swapped"] == 0 and s["free_blocks"] == s["total_blocks"]:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(engine.stats())


@pytest.fixture(scope="module")
def undisturbed():
    async def go():
        async with make_engine() as engine:
            return [out.token_ids for out in await run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS)])]
    return asyncio.run(go())


def fail_forwards(monkeypatch, failing: tuple[int, ...], error: Exception) -> dict:
    """Forwards number `failing` (counted from 1) raise `error`; the others run. Returns the
    count of forwards so far, {"n": ...}, which the caller may read."""
    calls = {"n": 0}

    def forward(batch, real):
        calls["n"] += 1
        if calls["n"] in failing:
            raise error
        return real(batch)

    patch_forward(monkeypatch, forward)
    return calls


def check_others(results, undisturbed, culprit):
    for i, (got, want) in enumerate(zip(results, undisturbed)):
        if i != culprit:
            assert not isinstance(got, BaseException), (i, got)
            assert got.token_ids == want, i


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_an_error_in_one_requests_sampling_setup_fails_it_alone(monkeypatch, undisturbed, async_scheduling):
    real_add = InputBatch.add

    def add(self, seq):  # where a request's sampling parameters are set up, once, as it starts running
        if seq.params.seed == 666:
            raise ValueError("this request's sampling setup is broken")
        return real_add(self, seq)

    monkeypatch.setattr(InputBatch, "add", add)

    async def go():
        async with make_engine(async_scheduling=async_scheduling) as engine:
            requests = [(p, params(666 if i == 3 else i)) for i, p in enumerate(PROMPTS)]
            results = await run_all(engine, requests)
            stats = await idle_stats(engine)
            again = await engine.generate(PROMPTS[0], params(0))
            return results, stats, again, engine.healthy
    results, stats, again, healthy = asyncio.run(go())
    assert isinstance(results[3], EngineError) and "sampling setup is broken" in str(results[3])
    check_others(results, undisturbed, culprit=3)
    assert healthy and again.token_ids == undisturbed[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_nan_logits_in_one_row_fail_that_request_alone(undisturbed, async_scheduling):
    async def go():
        # A small pool, so that the poisoned blocks are handed out again below.
        async with make_engine(async_scheduling=async_scheduling, num_blocks=24) as engine:
            requests = [(p, params(i)) for i, p in enumerate(PROMPTS)]
            requests[5] = ([1, 2, POISON, 3, 4, 6], params(5))
            results = await run_all(engine, requests)
            await idle_stats(engine)
            # The poisoned request's blocks went back to the pool with NaN in them: the next
            # requests that get them must not notice.
            after = await run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS)])
            return results, after
    results, after = asyncio.run(go())
    assert isinstance(results[5], EngineError) and "non-finite logits" in str(results[5])
    check_others(results, undisturbed, culprit=5)
    check_others(after, undisturbed, culprit=None)


def test_an_out_of_memory_forward_is_retried_and_changes_nothing(monkeypatch, undisturbed):
    # The first forward (all prompts at once) and a later one.
    calls = fail_forwards(monkeypatch, (1, 4), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))

    async def go():
        async with make_engine() as engine:
            results = await run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS)])
            return results, await idle_stats(engine), engine.core.scheduler.isolation.token_cap
    results, stats, cap = asyncio.run(go())
    check_others(results, undisturbed, culprit=None)
    assert calls["n"] > 4
    assert cap is not None  # the budget is still halved (it relaxes after a run of good steps)


def test_a_request_too_big_for_memory_fails_with_a_request_error_and_the_rest_finish(monkeypatch, undisturbed):
    """The forward runs out of memory whenever a sequence's context passes 60 tokens: the
    100-token prompt is chunked down to the smallest chunk, then failed with a clear 4xx."""

    def forward(batch, real):
        if int(batch.seq_lens.max()) > 60:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(batch)

    patch_forward(monkeypatch, forward)

    async def go():
        async with make_engine() as engine:
            requests = [(p, params(i)) for i, p in enumerate(PROMPTS)]
            requests[2] = (list(range(10, 110)), params(2))
            results = await run_all(engine, requests)
            return results, await idle_stats(engine), engine.healthy
    results, stats, healthy = asyncio.run(go())
    error = results[2]
    assert isinstance(error, EngineError) and isinstance(error.__cause__, RequestError)
    assert "out of memory" in str(error) and error.__cause__.param == "prompt"
    check_others(results, undisturbed, culprit=2)
    assert healthy


def test_a_transient_error_fails_nobody(monkeypatch, undisturbed):
    fail_forwards(monkeypatch, (3,), RuntimeError("a cosmic ray"))

    async def go():
        async with make_engine() as engine:
            return await run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS)]), engine.healthy
    results, healthy = asyncio.run(go())
    check_others(results, undisturbed, culprit=None)
    assert healthy


def test_an_error_outside_any_request_fails_those_in_flight_and_the_engine_keeps_serving(monkeypatch, undisturbed):
    async def go():
        engine = make_engine()
        real_plan, calls = engine.core.scheduler.plan, {"n": 0}

        def plan(now):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom in the scheduler")
            return real_plan(now)
        monkeypatch.setattr(engine.core.scheduler, "plan", plan)
        async with engine:
            results = await run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS[:4])])
            stats = await idle_stats(engine)
            again = await engine.generate(PROMPTS[0], params(0))
            return results, stats, again, engine.healthy
    results, stats, again, healthy = asyncio.run(go())
    assert all(isinstance(r, EngineError) and "boom in the scheduler" in str(r) for r in results)
    assert healthy and again.token_ids == undisturbed[0]


def test_a_device_error_is_fatal(monkeypatch):
    def forward(*args):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    patch_forward(monkeypatch, forward)

    async def go():
        async with make_engine() as engine:
            results = await run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS[:3])])
            healthy = engine.healthy
            with pytest.raises(EngineError, match="unhealthy"):
                engine.submit(PROMPTS[0], params(0))
            return results, healthy, engine.stats()
    results, healthy, stats = asyncio.run(go())
    assert all(isinstance(r, EngineError) and "illegal memory access" in str(r) for r in results)
    assert not healthy and stats["healthy"] is False and stats["free_blocks"] == stats["total_blocks"]


def test_n2_with_prompt_logprobs():
    """Issue 10, bug 1: the fork of an n=2 request asked for the prompt logprobs again, found
    none, and killed the engine with a TypeError."""
    async def go():
        async with make_engine() as engine:
            out = await engine.generate(PROMPTS[0], SamplingParams(n=2, prompt_logprobs=1, max_tokens=2, seed=1))
            return out, engine.healthy
    out, healthy = asyncio.run(go())
    assert healthy and [len(c.token_ids) for c in out.outputs] == [2, 2]
    assert len(out.prompt_logprobs) == len(PROMPTS[0]) and out.prompt_logprobs[0] is None


def test_closing_a_stream_aborts_at_once_and_frees_its_id():
    """Issue 10, bug 15: aclose() aborted two event-loop turns late, and the id stayed taken."""
    async def go():
        async with make_engine() as engine:
            stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), request_id="r1")
            await stream.__anext__()
            await stream.aclose()
            in_flight = engine.num_in_flight  # no await between: nothing else ran
            again = await engine.generate(PROMPTS[1], params(1), request_id="r1")
            return in_flight, again, await idle_stats(engine)
    in_flight, again, stats = asyncio.run(go())
    assert in_flight == 0 and again.finish_reason == "length"


# -- through the HTTP server -----------------------------------------------------------------


def sse_events(response) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, line[5:].strip()))
            name = None
    return events


def test_a_failed_request_gets_an_error_event_and_done_while_its_neighbour_streams_on(poisoned_server):
    import json
    import threading

    import httpx

    url = poisoned_server.url + "/v1/completions"
    good = {"prompt": [10, 11, 12, 13], "max_tokens": 24, "temperature": 0.7, "seed": 4, "stream": True}
    alone = "".join(json.loads(data)["choices"][0]["text"] for name, data in sse_events(
        httpx.post(url, json=good, timeout=30)) if data != "[DONE]")
    got = {}

    def run(key, body):
        with httpx.stream("POST", url, json=body, timeout=30) as r:
            got[key] = (r.status_code, sse_events(r))
    threads = [threading.Thread(target=run, args=("good", good)),
               threading.Thread(target=run, args=("bad", {**good, "prompt": [10, POISON, 12]}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, events = got["bad"]
    assert status == 200 and events[-1] == (None, "[DONE]")
    name, data = events[-2]
    error = json.loads(data)["error"]
    assert name == "error" and error["type"] == "server_error" and "non-finite logits" in error["message"]
    status, events = got["good"]
    assert events[-1] == (None, "[DONE]") and all(name is None for name, _ in events)
    assert "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1]) == alone
    assert httpx.get(poisoned_server.url + "/health").status_code == 200


def test_a_failed_request_is_a_500_and_the_server_keeps_serving(poisoned_server):
    import httpx

    url = poisoned_server.url + "/v1/completions"
    bad = httpx.post(url, json={"prompt": [POISON, 3], "max_tokens": 4}, timeout=30)
    assert bad.status_code == 500 and "non-finite logits" in bad.json()["error"]["message"]
    ok = httpx.post(url, json={"prompt": [3, 4], "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(poisoned_server.url + "/health").json() == {"status": "ok"}


def test_a_request_that_cannot_fit_in_memory_is_a_400(poisoned_server, monkeypatch):
    import httpx

    def forward(batch, real):
        if int(batch.seq_lens.max()) > 100:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(batch)

    patch_forward(monkeypatch, forward)
    url = poisoned_server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": list(range(20, 220)), "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "out of memory" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    assert httpx.post(url, json={"prompt": [3, 4], "max_tokens": 4}, timeout=30).status_code == 200


def test_a_lone_request_survives_a_one_off_fault(monkeypatch):
    """A failure is pinned on a request only when it comes back with that request alone."""
    fail_forwards(monkeypatch, (2,), ValueError("a one-off glitch"))

    async def go():
        async with make_engine() as engine:
            return await engine.generate(PROMPTS[0], params(0))
    assert asyncio.run(go()).finish_reason == "length"


def test_a_failure_while_preparing_a_step_fails_that_request_and_the_loop_lives_on(monkeypatch, undisturbed):
    """Review of issue 10: a swap that raised killed the worker thread (every request hung)."""
    real_swap, calls = kv_pools.swap_blocks, {"n": 0}

    def swap_blocks(src, dst, copies):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the copy engine hiccuped")
        return real_swap(src, dst, copies)

    monkeypatch.setattr(kv_pools, "swap_blocks", swap_blocks)

    async def go():
        async with make_engine(num_blocks=24, preemption_mode="swap", swap_space=1 << 22) as engine:
            results = await asyncio.wait_for(run_all(engine, [(p, params(i)) for i, p in enumerate(PROMPTS)]), 60)
            return results, await idle_stats(engine), engine.healthy
    results, stats, healthy = asyncio.run(go())
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert calls["n"] > 1 and len(failed) == 1 and "preparing this request's step" in str(results[failed[0]])
    check_others(results, undisturbed, culprit=failed[0])
    assert healthy


def test_the_token_cap_never_exceeds_the_budget():
    from runtime.engine.faults import Fault, Isolation

    isolation = Isolation(8)
    seqs = [engine_core.Sequence(i, [1, 2], SamplingParams(), 10) for i in range(2)]
    isolation.failed(seqs, 8, torch.OutOfMemoryError("x"), Fault.OUT_OF_MEMORY)
    assert isolation.step_budget() <= 8
