"""Peak memory of a step is bounded by the token budget, not by the prompt: the server, under
`ulimit -v` of about 3 GB with a 600-block pool, takes an 8,000-token prompt while 4 other
streams run, and all five finish — without the out-of-memory safety net ever firing (a long
prompt's prefill attention once materialised [heads, 4096, 8000] fp32 scores: 1.2 GB)."""

import asyncio
import json
import re
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow


async def stream(http, url, body, started: asyncio.Event | None = None):
    """The last chunk's finish reason and whether the stream ended with [DONE]."""
    reason, done = None, False
    async with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            assert not line.startswith("event: error"), line
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                if started is not None:
                    started.set()
                reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
    return reason, done


async def five_streams(url):
    async with httpx.AsyncClient(timeout=600) as http:
        started = [asyncio.Event() for _ in range(4)]
        bodies = [{"prompt": f"Story {i}: once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0.8,
                   "seed": i} for i in range(4)]
        running = [asyncio.create_task(stream(http, url, body, event)) for body, event in zip(bodies, started)]
        for event in started:
            await event.wait()
        long_prompt = list(range(1000, 9000))  # 8,000 token ids
        return await asyncio.gather(stream(http, url, {"prompt": long_prompt, "max_tokens": 4}), *running)


def test_an_8000_token_prompt_under_3gb_of_address_space(smollm2_gguf):
    command = (f"ulimit -v 3000000 && exec {sys.executable} -m runtime.cli serve --model {smollm2_gguf} "
               "--device cpu --port 0 --num-blocks 600")
    server = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, (line, server.stderr.read() if server.poll() is not None else "")
        results = asyncio.run(five_streams(match.group(0)))
    finally:
        server.terminate()
        log = server.communicate(timeout=60)[1]
    assert results == [("length", True)] * 5, results
    assert "failed" not in log, log  # no step ran out of memory, not even once
