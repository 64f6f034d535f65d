"""`serve --api-server-count N` (issue 60): N HTTP front processes on one port over one engine process — the same
answers from each, a front that dies loses only its own requests, and no process outlives the first front."""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.test_data_parallel import ROOT, _alive, descendants

pytestmark = pytest.mark.slow  # (the default model, loaded by an engine process, with two fronts)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def start(gguf, *extra) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", str(gguf), "--device", "cpu",
                               "--port", "0", "--api-server-count", "2", "--log-level", "info", *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    return server, server.stdout.readline().split(" at ")[1].split()[0]


def complete(url: str, stream: bool, max_tokens: int = 12) -> str:
    """One request on a connection of its own (the kernel picks its front)."""
    body = {"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.Client(base_url=url, timeout=120) as http:
        if not stream:
            return http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json=body) as r:
            return "".join(__import__("json").loads(line[6:])["choices"][0]["text"]
                           for line in r.iter_lines() if line.startswith("data: {"))


def test_two_api_servers_share_the_port_and_the_engine_and_stop_together(smollm2_gguf):
    server, url = start(smollm2_gguf)
    try:
        whole = complete(url, stream=False)
        with ThreadPoolExecutor(16) as pool:
            streamed = list(pool.map(lambda i: complete(url, stream=i % 2 == 0), range(32)))
        assert streamed == [whole] * 32
        children = descendants(server.pid)
        assert len(children) == 2  # the engine process and API server 1
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        err = server.stderr.read()
    assert code == 0, err[-2000:]
    fronts = {"[api server 1]" if line.startswith("[api server 1]") else "first"
              for line in err.splitlines() if re.search(r"cmpl-\w+: 200", line)}
    assert fronts == {"first", "[api server 1]"}, err[-2000:]  # (32 connections: both fronts took some)
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, children))


def test_a_killed_api_server_loses_only_its_own_requests(smollm2_gguf):
    server, url = start(smollm2_gguf)
    try:
        (api_server,) = [pid for pid in descendants(server.pid)
                         if b"runtime.serve.api_servers" in open(f"/proc/{pid}/cmdline", "rb").read()]
        with ThreadPoolExecutor(16) as pool:  # (16 connections: the kernel gives each front some)
            long = [pool.submit(complete, url, True, 80) for _ in range(16)]
            deadline = time.monotonic() + 60  # (a front that refuses them fails here, not by hanging the suite)
            while metric(url, "nanoinfer_requests_running") < 16:
                assert time.monotonic() < deadline, "the 16 streams never ran together"
                time.sleep(0.05)
            os.kill(api_server, signal.SIGKILL)
            texts = [f.exception() or f.result() for f in long]
        whole = complete(url, stream=False, max_tokens=80)
        served = [t for t in texts if t == whole]
        assert 0 < len(served) < 16, texts  # the first front's streams ended whole, the dead one's did not
        deadline = time.monotonic() + 10  # the dead front's requests were aborted in the engine: nothing left
        while metric(url, "nanoinfer_requests_running") or metric(url, "nanoinfer_kv_blocks_used"):
            assert time.monotonic() < deadline, "the killed API server's requests still run in the engine"
            time.sleep(0.1)
        assert httpx.get(url + "/health").status_code == 200
        assert complete(url, stream=False) == complete(url, stream=True)  # (the first front serves on)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0


def test_a_killed_first_front_takes_every_process_with_it(smollm2_gguf):
    server, url = start(smollm2_gguf, "--log-level", "warning")
    children = descendants(server.pid)
    assert len(children) == 2
    server.kill()
    server.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, children))


def test_several_api_servers_need_the_engine_in_a_process_of_its_own(smollm2_gguf):
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--model", str(smollm2_gguf), "--device",
                           "cpu", "--port", "0", "--api-server-count", "2", "--engine-process", "off"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--api-server-count 2 needs the engine in a process of its own: expected --engine-process on or auto, not off")
