"""The server's engine in a process of its own (issue 60): the same outputs as in-process, and its faults
contained — a dead engine process fails what was in flight by name, /health says 503 at once, the front keeps
answering, and no process outlives the front."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from nanoinfer import EngineError, SamplingParams
from runtime.async_engine import AsyncEngine
from runtime.engine_process.data_parallel import data_parallel_from_loaded
from tests.live_server import LiveServer
from tests.test_data_parallel import GREEDY, MODEL, ROOT, SCRIPT, _alive, config, descendants, prompts


def engine_process(**kw):
    return data_parallel_from_loaded(MODEL, config(**kw))  # (data_parallel_size 1: one engine process)


def slow_steps(index, engine):
    """(`_setup`) Steps of 50 ms: requests are surely running when a test kills the process."""
    forward = engine.core.executor._forward
    engine.core.executor._forward = lambda batch: (time.sleep(0.05), forward(batch))[1]


def test_greedy_outputs_equal_the_in_process_engines():
    batch = prompts(6, seed=3)

    async def run(engine):
        async with engine:
            return [out.token_ids for out in await asyncio.gather(*(engine.generate(p, GREEDY) for p in batch))]
    assert asyncio.run(run(engine_process())) == asyncio.run(run(AsyncEngine(MODEL, config())))


def test_what_the_front_posts_meanwhile_goes_to_the_engine_as_one_message():
    """A burst admitted in one loop iteration crosses as one list (one pickle, one write), which the replica
    reads command by command; a lone message goes as itself."""
    from runtime.engine_process import messages as msg
    from runtime.engine_process.client import ReplicaLink

    class Conn:
        sent = []

        def send(self, message):
            self.sent.append(message)

    link = ReplicaLink(0, None, Conn(), step_timeout=1.0)
    burst = [msg.Abort(key) for key in range(5)]
    for message in burst:
        link.post(message)
    link._outbox.put(None)
    link._write()
    assert Conn.sent == [burst]
    Conn.sent.clear()
    link.post(msg.Abort(7))
    link._outbox.put(None)
    link._write()
    assert Conn.sent == [msg.Abort(7)]


def test_a_killed_engine_process_fails_its_requests_by_name_and_takes_no_more():
    engine = data_parallel_from_loaded(MODEL, config(), _setup="tests.test_engine_process:slow_steps")

    async def go():
        async with engine:
            handle = engine.submit(prompts(1)[0], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
            while engine.stats()["generated_tokens"] == 0:
                await asyncio.sleep(0.01)
            os.kill(engine.replicas[0].process.pid, signal.SIGKILL)
            killed = time.monotonic()
            (failed,) = await asyncio.gather(engine.collect(handle), return_exceptions=True)
            after = time.monotonic() - killed
            with pytest.raises(EngineError, match="the engine process is down"):
                engine.submit([1, 2, 3], GREEDY)
            return failed, after, engine.healthy
    failed, after, healthy = asyncio.run(go())
    assert isinstance(failed, EngineError) and "the engine process exited (code -9, SIGKILL)" in str(failed)
    assert after < 5 and not healthy
    assert not descendants(os.getpid())


def test_the_server_reports_a_dead_engine_process_and_keeps_answering(tiny_chat_model):
    with LiveServer(tiny_chat_model, engine_process="on") as live:
        body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=live.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))  # (running)
                os.kill(live.engine.replicas[0].process.pid, signal.SIGKILL)
                killed = time.monotonic()
                rest = list(lines)
            events = [line for line in rest if line]
            assert events[-3] == "event: error" and "the engine process exited" in events[-2], events[-4:]
            assert events[-1] == "data: [DONE]"
            while http.get("/health").status_code != 503:
                assert time.monotonic() - killed < 5, "/health still says ok 5 s after the engine died"
                time.sleep(0.05)
            refused = http.post("/v1/completions", json={**body, "max_tokens": 2})
            assert refused.status_code == 503 and "engine" in refused.json()["error"]["message"]
            assert http.get("/v1/models").status_code == 200  # (the front answers on)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stdin", "script without a main guard"])
def test_an_engine_process_starts_from_any_program_and_dies_with_its_front(how, tmp_path):
    script = SCRIPT.replace("data_parallel_size=2", "data_parallel_size=1").replace("asyncio.run(run())", """
asyncio.run(run())
engine = data_parallel_from_loaded(model, engine_config(block_size=4, num_blocks=64))
print("PIDS", *(r.process.pid for r in engine.replicas), flush=True)
import time
time.sleep(300)
""")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if how == "stdin":
        front = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=tmp_path, env=env)
        front.stdin.write(script)
        front.stdin.close()
    else:
        (tmp_path / "no_guard.py").write_text(script)
        front = subprocess.Popen([sys.executable, "no_guard.py"], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                                 env=env)
    out = front.stdout.readline()
    assert out.startswith("OUT [0, 0] [5, 5]"), out
    line = front.stdout.readline()
    assert line.startswith("PIDS"), line
    (pid,) = [int(p) for p in line.split()[1:]]
    front.kill()
    front.wait()
    deadline = time.monotonic() + 10  # (the engine process polls its parent every half second)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


@pytest.mark.slow
def test_serve_with_an_engine_process_stops_cleanly_on_sigterm(smollm2_gguf):
    server = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", str(smollm2_gguf),
                               "--device", "cpu", "--port", "0", "--engine-process", "on", "--log-level", "warning"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = server.stdout.readline().split(" at ")[1].split()[0]
        done = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                         "temperature": 0}, timeout=120)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        children = descendants(server.pid)
        assert children  # (the engine process)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
    assert code == 0
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, children))


@pytest.mark.slow
def test_the_front_detokenizes_and_matches_stop_strings_as_one_engine_does(tiny_chat_model):
    """The engine process sends tokens; its front files them, detokenizes and matches stop strings (and tells the
    engine to stop a completion that matched): texts, ids, logprobs and finish reasons equal one engine's."""
    prompt, free = "The weather today", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run(engine, params_list):
        async with engine:
            results = []
            for params in params_list:
                results.append(await engine.generate(prompt, params))
                streamed = [out async for out in engine.stream(prompt, params)]
                results.append("".join(o.text for o in streamed))
            await asyncio.sleep(0.2)  # (the stopped completions' ends reach the engine)
            return results, engine.stats()

    cfg = config(block_size=16, num_blocks=256)
    one, _ = asyncio.run(run(AsyncEngine(tiny_chat_model, cfg), [free]))
    stop = one[0].text[8:12]  # (a piece of the greedy text: where it stops is known)
    cases = [free, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
             SamplingParams(temperature=0.8, n=2, seed=5, max_tokens=12, ignore_eos=True, logprobs=2, stop=[stop]),
             SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, logprobs=1)]
    want, _ = asyncio.run(run(AsyncEngine(tiny_chat_model, cfg), cases))
    got, stats = asyncio.run(run(data_parallel_from_loaded(tiny_chat_model, cfg), cases))
    assert want[2].finish_reason == "stop" and not want[2].text.endswith(stop)  # (the case is what it claims)
    for w, g in zip(want, got):
        if isinstance(w, str):
            assert g == w
            continue
        assert [(c.text, c.token_ids, c.finish_reason) for c in g.outputs] == \
               [(c.text, c.token_ids, c.finish_reason) for c in w.outputs]
        # (A completion a stop string ends runs a step or two more in the engine process, until the front's word
        # arrives: its sibling shares those steps' batch, and the eager fp32 path's last bits follow the batch.)
        for cg, cw in zip(g.outputs, w.outputs):
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in cg.logprobs or ()] == \
                   [(lp.token_id, [t for t, _ in lp.top]) for lp in cw.logprobs or ()]
            assert [lp.logprob for lp in cg.logprobs or ()] == pytest.approx([lp.logprob for lp in cw.logprobs or ()],
                                                                             abs=1e-5)
        assert g.prompt_logprobs == w.prompt_logprobs
    replica = stats["replicas"][0]
    assert replica["running"] == 0 and replica["free_blocks"] == replica["total_blocks"]


def stopped_mid_stream(live, body, hang):
    """Stream `body` from `live`, call `hang` once it runs; the stream's last events, and the seconds until
    /health said 503 after `hang`."""
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # (running)
            hang()
            began = time.monotonic()
            events = [line for line in lines if line]
        while http.get("/health").status_code != 503:
            assert time.monotonic() - began < 10, "/health still says ok 10 s after the engine hung"
            time.sleep(0.05)
        return events[-3:], time.monotonic() - began


def test_a_stopped_engine_process_is_killed_as_hung_and_its_requests_fail(tiny_chat_model):
    """SIGSTOP: the process lives but says nothing (no beat): its front kills it within msg.SILENCE seconds."""
    with LiveServer(tiny_chat_model, engine_process="on") as live:
        pid = live.engine.replicas[0].process.pid
        body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        events, took = stopped_mid_stream(live, body, lambda: os.kill(pid, signal.SIGSTOP))
        assert events[0] == "event: error" and "it said nothing for 3 s: killed" in events[1], events
        assert events[-1] == "data: [DONE]" and took < 5
        assert not _alive(pid)


def very_slow_steps(index, engine):
    """(`_setup`) After the first few, a step of 30 s: a hung step, as a GPU that never answers makes one."""
    forward, calls = engine.core.executor._forward, [0]

    def slow(batch):
        calls[0] += 1
        if calls[0] > 3:
            time.sleep(30)
        return forward(batch)
    engine.core.executor._forward = slow


def test_a_step_past_the_step_timeout_kills_the_engine_process(tiny_chat_model):
    engine = data_parallel_from_loaded(tiny_chat_model, config(block_size=16, num_blocks=256, step_timeout=2.0),
                                       _setup="tests.test_engine_process:very_slow_steps")

    async def go():
        async with engine:
            began = time.monotonic()
            (failed,) = await asyncio.gather(engine.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True)),
                                             return_exceptions=True)
            return failed, time.monotonic() - began, engine.healthy
    failed, took, healthy = asyncio.run(go())
    assert isinstance(failed, EngineError) and "a step ran for more than 2 s: killed" in str(failed)
    assert took < 10 and not healthy and not descendants(os.getpid())


def test_a_waiting_non_stream_request_gets_a_503_naming_the_dead_engine_process(tiny_chat_model):
    import threading

    with LiveServer(tiny_chat_model, engine_process="on") as live:
        body = {"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        answer = {}
        waiting = threading.Thread(target=lambda: answer.update(r=httpx.post(live.url + "/v1/completions", json=body,
                                                                                timeout=60)))
        waiting.start()
        while live.engine.stats()["generated_tokens"] == 0:
            time.sleep(0.01)
        os.kill(live.engine.replicas[0].process.pid, signal.SIGKILL)
        waiting.join(30)
        r = answer["r"]
        assert r.status_code == 503 and "the engine process exited (code -9, SIGKILL)" in r.json()["error"]["message"]


def dead_device_at_step_5(index, engine):
    """(`_setup`) The fifth step meets a device error nothing on it survives (the process lives on)."""
    from runtime.engine.faults import EngineDead

    step, calls = engine.core.step, [0]

    def failing():
        calls[0] += 1
        if calls[0] == 5:
            raise EngineDead("the device failed: CUDA error: an illegal memory access was encountered")
        return step()
    engine.core.step = failing


def test_a_dead_device_in_the_engine_process_fails_everything_by_its_error_and_the_front_says_503(tiny_chat_model):
    engine = data_parallel_from_loaded(tiny_chat_model, config(block_size=16, num_blocks=256),
                                       _setup="tests.test_engine_process:dead_device_at_step_5")

    async def go():
        async with engine:
            results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=40, ignore_eos=True))
                                             for p in ("Hello", "The sea", "One two")), return_exceptions=True)
            with pytest.raises(EngineError, match="the engine process is down"):
                engine.submit("again", GREEDY)
            return results, engine.healthy, engine.replicas[0].process.exit_code()
    results, healthy, code = asyncio.run(go())
    assert all(isinstance(r, EngineError) and "illegal memory access" in str(r) for r in results), results
    assert not healthy and code is None  # (the process lived on, its engine dead: the front refuses for it)
