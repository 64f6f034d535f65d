"""AsyncEngine on a tiny random model: batching and chunking are invisible, preemption by
recompute and swap changes nothing, priorities and aging, cancellation frees everything,
the event loop stays responsive, errors fail only who they should."""

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest

from nanoinfer import AsyncEngine, EngineError, RequestError, SamplingParams
from nanoinfer.loaders import LoadedModel
from runtime.async_engine import engine_config
from tests.tiny import random_params, tiny_config

CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)
MODEL = LoadedModel(CFG, random_params(CFG, seed=3), None, Path("tiny-random"))


def make_engine(**engine_args) -> AsyncEngine:
    args = dict(block_size=4, num_blocks=512)
    args.update(engine_args)
    return AsyncEngine(MODEL, engine_config(**args))


def prompts(n, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens=16):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def run_all(engine, prompt_list, params, **kw):
    return await asyncio.gather(*(engine.generate(p, params, **kw) for p in prompt_list))


async def wait_idle(engine, timeout=10.0):
    """Until the worker reports nothing running and every block free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == s["waiting"] == s["swapped"] == 0 and s["free_blocks"] == s["total_blocks"]:
            return s
        await asyncio.sleep(0.005)
    raise AssertionError(f"engine not idle: {engine.stats()}")


@pytest.fixture(scope="module")
def alone_outputs():
    """Each of 32 prompts run on its own: the reference."""
    async def go():
        async with make_engine() as engine:
            return [(await engine.generate(p, greedy())).token_ids for p in prompts(32)]
    return asyncio.run(go())


@pytest.mark.parametrize("chunk", [1, 7, 64, None], ids=["chunk1", "chunk7", "chunk64", "unlimited"])
def test_concurrent_greedy_equals_alone(alone_outputs, chunk):
    async def go():
        async with make_engine(max_num_batched_tokens=chunk or 100_000) as engine:
            outs = await run_all(engine, prompts(32), greedy())
            await wait_idle(engine)
            return outs
    outs = asyncio.run(go())
    assert [o.token_ids for o in outs] == alone_outputs
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs)


def test_async_scheduling_through_the_worker(alone_outputs):
    """The overlapped step loop (CUDA's default) under the real worker and many clients."""
    async def go():
        async with make_engine(max_num_batched_tokens=7, async_scheduling=True) as engine:
            assert engine.core.async_scheduling
            outs = await run_all(engine, prompts(32), greedy())
            return outs, await wait_idle(engine)
    outs, stats = asyncio.run(go())
    assert [o.token_ids for o in outs] == alone_outputs
    assert stats["generated_tokens"] == 32 * 16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_no_output(mode):
    reqs = prompts(64, seed=1, lo=4, hi=24)

    async def go(**kw):
        async with make_engine(**kw) as engine:
            outs = await run_all(engine, reqs, greedy(20))
            return outs, await wait_idle(engine)

    roomy, _ = asyncio.run(go())
    # 24 blocks of 4 slots hold about two requests at full length: preemption is constant.
    tight, stats = asyncio.run(go(num_blocks=24, preemption_mode=mode, swap_space=1 << 20))
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert stats["num_preemptions"] > 0
    assert stats["free_blocks"] == stats["total_blocks"] == 24


def test_high_priority_overtakes_a_queue():
    async def go():
        async with make_engine(scheduling_policy="priority", max_num_seqs=4, aging_steps=10_000) as engine:
            first_token_at = {}

            async def consume(name, prompt, priority):
                async for out in engine.stream(prompt, greedy(8), priority=priority):
                    first_token_at.setdefault(name, time.monotonic())
            tasks = [asyncio.create_task(consume(i, p, 10)) for i, p in enumerate(prompts(50, seed=2))]
            tasks.append(asyncio.create_task(consume("vip", prompts(1, seed=3)[0], 0)))
            await asyncio.gather(*tasks)
            return first_token_at
    first = asyncio.run(go())
    later = [name for name in range(50) if first[name] > first["vip"]]
    # Only the few admitted before the VIP's submission reached the worker can be ahead of it.
    assert len(later) >= 45, sorted(first, key=first.get)[:10]


@pytest.mark.parametrize("aging", [5, 20])
def test_aging_bounds_the_wait_of_a_low_priority_request(aging):
    async def go():
        async with make_engine(scheduling_policy="priority", max_num_seqs=2, aging_steps=aging) as engine:
            stop = asyncio.Event()

            async def flood():  # a steady stream of high-priority work, always two waiting
                pending = set()
                while not stop.is_set():
                    while len(pending) < 4:
                        pending.add(asyncio.create_task(engine.generate(prompts(1, seed=len(pending))[0], greedy(4),
                                                                        priority=0)))
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
            flooder = asyncio.create_task(flood())
            await asyncio.sleep(0.05)
            start_step = engine.stats()["steps"]
            # Without aging this would wait for ever behind the flood: bound it in time too.
            await asyncio.wait_for(engine.generate(prompts(1, seed=99)[0], greedy(4), priority=3), timeout=30)
            waited = engine.stats()["steps"] - start_step
            stop.set()
            await flooder
            return waited
    waited = asyncio.run(go())
    # Priority 3 reaches the flood's 0 after 3 * aging steps, then wins on arrival; then it
    # needs its prefill and 4 tokens. Allow a few steps of slack for hand-off latency.
    assert waited <= 3 * aging + 4 + 10, waited


def test_cancelled_streams_free_everything():
    async def go():
        async with make_engine(num_blocks=256, max_num_seqs=64) as engine:
            rng = random.Random(4)

            async def consume(prompt, stop_after):
                async for i, _ in aenumerate(engine.stream(prompt, greedy(40))):
                    if i >= stop_after:
                        break  # leaving the loop aborts the request

            async def cancel_later(task, delay):
                await asyncio.sleep(delay)
                task.cancel()

            tasks = []
            for i, p in enumerate(prompts(200, seed=5)):
                if i % 2:
                    tasks.append(asyncio.create_task(consume(p, rng.randint(0, 10))))
                else:
                    task = asyncio.create_task(consume(p, 10_000))
                    asyncio.create_task(cancel_later(task, rng.uniform(0, 0.3)))
                    tasks.append(task)
            await asyncio.gather(*tasks, return_exceptions=True)
            return await wait_idle(engine)
    stats = asyncio.run(go())
    assert stats["running"] == 0 and stats["free_blocks"] == 256


async def aenumerate(aiter):
    i = 0
    async for item in aiter:
        yield i, item
        i += 1


def test_event_loop_stays_responsive():
    async def go():
        async with make_engine(max_num_batched_tokens=512) as engine:
            gaps, running = [], True

            async def ticker():
                last = time.monotonic()
                while running:
                    await asyncio.sleep(0.001)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
            tick = asyncio.create_task(ticker())
            await run_all(engine, prompts(48, seed=6, lo=20, hi=60), greedy(24))
            running = False
            await tick
            return gaps
    gaps = asyncio.run(go())
    assert len(gaps) > 50
    assert max(gaps) < 0.25, max(gaps)  # the loop never waits on a step (steps here take ms)


def test_stream_deltas_and_coalescing_for_a_slow_consumer():
    async def go():
        async with make_engine() as engine:
            whole = await engine.generate(prompts(1)[0], greedy(30))
            items = []
            async for out in engine.stream(prompts(1)[0], greedy(30)):
                items.append(out)
                await asyncio.sleep(0.02)  # slower than the engine: deltas pile up and coalesce
            return whole, items
    whole, items = asyncio.run(go())
    assert sum((list(o.token_ids) for o in items), []) == list(whole.token_ids)
    assert len(items) < 30, "a slow consumer gets coalesced deltas, not one item per token"
    assert items[-1].finished and items[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in items[:-1])


def test_bad_requests_fail_alone():
    async def go():
        async with make_engine(max_model_len=64) as engine:
            good = asyncio.create_task(engine.generate(prompts(1)[0], greedy(10)))
            with pytest.raises(RequestError, match="max_model_len"):
                await engine.generate([1] * 64, greedy())
            with pytest.raises(RequestError, match="out of range"):
                await engine.generate([1, 500], greedy())
            with pytest.raises(RequestError, match="string, a list of token ids"):
                await engine.generate([1.5, 2], greedy())
            with pytest.raises(RequestError, match="string, a list of token ids"):
                await engine.generate([1, True], greedy())  # (a bool is no token id, though Python calls it an int)
            with pytest.raises(RequestError, match="token id -1 is out of range"):
                await engine.generate([3, -1, 2], greedy())
            with pytest.raises(RequestError, match="no tokenizer"):
                await engine.generate("text needs a tokenizer", greedy())
            engine_ok = (await good).finish_reason == "length"
            return engine_ok, engine.healthy
    assert asyncio.run(go()) == (True, True)


def test_the_request_limits_name_a_bad_prompt_id_whatever_its_kind():
    """The core's own check (benches and the engine core call it without the front's): a bool or a float
    among the ids is named, as an id out of range is."""
    from runtime.engine.request_limits import RequestLimits

    limits = RequestLimits(vocab_size=100, max_model_len=64, max_num_seqs=4, block_size=16, num_blocks=8)
    for ids, bad in (([1, True], "True"), ([1, 2.0], "2.0"), ([1, 100], "100"), ([-1], "-1")):
        with pytest.raises(RequestError, match=f"prompt token id {bad} is out of range"):
            limits.check(ids, SamplingParams())


def test_abort_by_request_id():
    async def go():
        async with make_engine() as engine:
            outs = []

            async def consume():
                async for out in engine.stream(prompts(1)[0], greedy(10_000 // 100), request_id="req-1"):
                    outs.append(out)
                    if len(outs) == 3:
                        engine.abort("req-1")
            await consume()
            return outs, await wait_idle(engine)
    outs, stats = asyncio.run(go())
    assert outs[-1].finish_reason == "abort" and len(outs) <= 5
    assert stats["free_blocks"] == stats["total_blocks"]


def test_the_profiling_step_runs_the_costliest_path():
    """What sizes the GPU's KV pool (runtime/executor/kv_budget.py) is a real step: forward, the sampler's
    sort, penalties and logprobs for every row. It runs anywhere; here on the CPU."""
    from runtime.executor.kv_budget import run_peak_step

    run_peak_step(MODEL, engine_config(max_num_batched_tokens=64, max_num_seqs=8), make_engine().core.executor.attention)


def test_a_slow_consumer_gets_the_stop_reason_and_no_tokens_past_the_stop(tiny_chat_model):
    """Review of issue 10: when the worker's last token arrived in the same coalesced delta as
    the stop string's match, the stream ended with "length" and every token past the stop."""
    greedy_16 = dict(temperature=0, max_tokens=16, ignore_eos=True)

    async def go():
        async with AsyncEngine(tiny_chat_model, engine_config(block_size=16, num_blocks=256)) as engine:
            base = await engine.generate("The sea", SamplingParams(**greedy_16))
            stop = base.text[3:7]
            params = SamplingParams(**greedy_16, stop=[stop])
            fast = await engine.generate("The sea", params)
            items = []
            async for out in engine.stream("The sea", params):
                items.append(out)
                await asyncio.sleep(0.3)  # the worker finishes all 16 tokens meanwhile
            return base, stop, fast, items
    base, stop, fast, items = asyncio.run(go())
    assert fast.finish_reason == "stop" and fast.text == base.text[:base.text.index(stop)]
    assert len(fast.token_ids) < 16
    assert items[-1].finish_reason == "stop"
    assert "".join(o.text for o in items) == fast.text
    assert sum((list(o.token_ids) for o in items), []) == list(fast.token_ids)


def test_a_declared_context_past_the_kv_pool_sizes_nothing_by_it():
    """A model may declare billions of positions (a long-context or hostile file's context_length): the
    engine's tables are sized for the longest sequence its KV pool can hold, not for that."""
    import dataclasses

    from runtime.engine.engine_core import EngineCore

    huge = dataclasses.replace(MODEL, config=dataclasses.replace(CFG, max_position_embeddings=1 << 32))
    core = EngineCore(huge, engine_config(block_size=4, num_blocks=64))
    assert core.max_model_len == 64 * 4 == core.limits.max_model_len
    assert core.executor.batch.table.numel() <= (core.config.scheduler.max_num_seqs + 8) * 64
    with pytest.raises(RequestError, match="max_model_len=256"):
        core.check_request([1] * 300, greedy())


def test_prepare_checks_ids_and_short_text_on_the_loop_and_the_rest_on_a_thread(monkeypatch):
    """A thread hop costs a server's burst more than checking token ids (issue 60): `prepare` makes a request of
    ids or of a short text on the loop's thread, and a long text or chat messages on another."""
    from runtime.engine.llm_engine import CHEAP_TEXT

    threads = []
    engine = make_engine()
    new_request = engine.engine.new_request
    monkeypatch.setattr(engine.engine, "new_request",
                        lambda *a, **kw: (threads.append(threading.current_thread()), new_request(*a, **kw))[1])

    async def go():
        async with engine:
            state = await engine.prepare([5, 6, 7], greedy(2))
            assert (await engine.collect(engine.enqueue(state))).token_ids
            for text in ("short text", "x" * (CHEAP_TEXT + 1)):  # (this model has no tokenizer: refused, where made)
                with pytest.raises(RequestError, match="no tokenizer"):
                    await engine.prepare(text, greedy(2))
    asyncio.run(go())
    main = threading.main_thread()
    assert threads[:2] == [main, main] and threads[2] is not main


def test_close_gives_the_memory_back_and_takes_no_more_prompts(smollm2_gguf):
    """After `close()` (or the end of `with LLM(...)`) nothing of the engine holds its weights, KV pool or step
    buffers (issue 64: a closed 8B engine still held 78 GiB of an H100; on the CPU close() gave back nothing), and
    a new prompt is refused by name."""
    import gc
    import weakref

    from nanoinfer import LLM
    from nanoinfer.model.decoder import map_params

    with LLM(smollm2_gguf, device="cpu", progress=False) as llm:
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        held = []
        map_params(lambda t: held.append(weakref.ref(t)) or t, llm.model.params)
        runner = llm.engine.core.executor
        held += [weakref.ref(runner.kv), weakref.ref(runner.pools)]
    gc.collect()
    assert len(held) > 10 and [ref for ref in held if ref() is not None] == []
    assert llm.model.params is None and llm.model.tokenizer is not None  # (the config and tokenizer stay)
    with pytest.raises(EngineError, match="closed"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_shut_down_async_engine_refuses_to_start_again():
    """Its shutdown gave the memory back (close): a second `async with` says so at once, not at each request."""
    engine = make_engine()

    async def go():
        async with engine:
            await engine.generate([1, 2, 3], greedy(2))
        with pytest.raises(EngineError, match="closed"):
            async with engine:
                pass
    asyncio.run(go())


def test_only_ids_and_short_texts_are_cheap_to_prepare():
    """What `prepare` makes on the loop: no chat messages, nothing with a grammar (a compile, or a replica's
    answer about one, may take seconds), nothing but a list or tuple of ids (an array, a generator)."""
    import numpy as np

    from runtime.engine.llm_engine import CHEAP_IDS, CHEAP_TEXT, cheap_to_prepare

    assert cheap_to_prepare([1, 2]) and cheap_to_prepare((1, 2)) and cheap_to_prepare([]) and cheap_to_prepare("hi")
    assert not cheap_to_prepare([1] * (CHEAP_IDS + 1)) and not cheap_to_prepare("x" * (CHEAP_TEXT + 1))
    assert not cheap_to_prepare([{"role": "user", "content": "hi"}])
    assert not cheap_to_prepare(np.array([1, 2])) and not cheap_to_prepare(i for i in (1, 2))
    grammar = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert not cheap_to_prepare([1, 2], grammar)
