"""Many streams on the CPU: N concurrent SSE streams through `nanoinfer serve` against llama-cpp-python's server.

    python bench/cpu_serving.py [--clients 8] [--max-tokens 128] [--threads 2] [--repeats 3] [--isa avx2 native]
                                [--llama-path /work/llamacpp:/work/llamacpp-extra] [--llama-server BIN]

Both servers load the same GGUF file (the default model's Q4_1) with the same thread count and get the same
requests: `--clients` text prompts (seeded, 16 to 64 words) sent at once to /v1/completions, streaming, greedy,
`--max-tokens` each, every stream run to its length (ours: ignore_eos; llama-cpp-python has none: a -100 bias on
its end-of-generation ids; not min_tokens too, since 0.3.16 then drops both processors: `LogitsProcessorList.extend`
returns None); a stream that ends early is an error, not a short count.
Aggregate tok/s = all streams' tokens / wall time from the first request sent to the last stream's end; TTFT = a
request sent to its first content chunk. Each round uses fresh prompts (so no prefix cache helps a later round), the
same for every server; servers run alternately, round by round, and the best round of each is kept (the CPU is
shared). llama-cpp-python's server holds one llama context and a lock: it serves one request at a time, the others
wait (its --interrupt_requests, on by default, would cut the running stream instead, so it is turned off).
`--llama-server BIN` adds llama.cpp's own C++ server (one slot per client, continuous batching), which is what
serves many streams in llama.cpp. `--isa` starts one of our servers per tier (NANOINFER_CPU_ISA).
llama-cpp-python's server needs its extras (fastapi, sse-starlette, starlette-context, pydantic-settings), given
with --llama-path, kept out of our package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from runtime.eval.speed import percentile

DEFAULT_GGUF = Path.home() / ".cache/nanoinfer/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
# The ids llama.cpp treats as end of generation in SmolLM2 (llama_token_is_eog): it stops on any of them.
EOG_IDS = (0, 2, 4)
WORDS = ("the river city night market light old story people winter machine garden music north road friend "
         "letter summer mountain train window history small quiet bright long journey house language sea "
         "morning village book team question bridge storm island field answer voice year")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts_for(round_no: int, clients: int) -> list[str]:
    rng, words = random.Random(1000 + round_no), WORDS.split()
    return [f"Write a long essay about {' '.join(rng.choice(words) for _ in range(rng.randint(16, 64)))}."
            for _ in range(clients)]


class Server:
    """One server process, its URL and the extra request fields it needs to run every stream to its length."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, extra: dict):
        self.name, self.url, self.extra = name, f"http://127.0.0.1:{port}", extra
        # A file, not a pipe: a chatty server would fill a pipe nobody reads and block. It lives as the server does.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"{self.name} exited ({self.process.returncode}): {self.log.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} not ready after {timeout:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def one_stream(http: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **server.extra}
    start = time.perf_counter()
    ttft, finish = None, None
    async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{server.name}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if ttft is None and choice.get("text"):
                    ttft = time.perf_counter() - start
                finish = choice.get("finish_reason") or finish
    if finish != "length":
        raise SystemExit(f"{server.name}: a stream ended with finish_reason {finish!r}, not 'length'")
    return ttft, max_tokens


async def one_round(server: Server, prompts: list[str], max_tokens: int) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(timeout=1200) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(http, server, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - start
    return sum(n for _, n in results) / elapsed, [t for t, _ in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--isa", nargs="*", default=["avx2", "native"], help="our kernel tiers, one server each "
                                                                            "(native: the best the CPU has)")
    parser.add_argument("--llama-path", default="/work/llamacpp:/work/llamacpp-extra",
                        help="PYTHONPATH for llama-cpp-python and its server extras ('' leaves it out)")
    parser.add_argument("--llama-server", type=Path, default=None, metavar="BIN",
                        help="also llama.cpp's C++ llama-server binary (built from the same vendored llama.cpp), "
                             "with one parallel slot per client")
    args = parser.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"--gguf {args.gguf}: no such file")

    threads = str(args.threads)
    servers = []
    try:
        for isa in args.isa:
            env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": os.getcwd()}
            if isa != "native":
                env["NANOINFER_CPU_ISA"] = isa
            port = free_port()
            servers.append(Server(f"nanoinfer serve ({isa})", [sys.executable, "-m", "runtime.cli", "serve", "--model",
                                                               str(args.gguf), "--device", "cpu", "--port", str(port),
                                                               "--log-level", "warning"],
                                  env, port, {"ignore_eos": True}))
        if args.llama_path:
            port = free_port()
            env = {**os.environ, "PYTHONPATH": args.llama_path}
            servers.append(Server("llama-cpp-python server", [
                sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--host", "127.0.0.1", "--port",
                str(port), "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "2048",
                "--interrupt_requests", "False", "--verbose", "False"], env, port,
                {"logit_bias": {str(i): -100 for i in EOG_IDS}}))
        if args.llama_server:  # llama.cpp's own server: one slot per client, batched together
            port = free_port()
            servers.append(Server(f"llama-server -np {args.clients}", [
                str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
                "-tb", threads, "-np", str(args.clients), "-c", str(args.clients * 512), "--log-disable"],
                os.environ.copy(), port, {"ignore_eos": True}))
        for server in servers:
            server.wait_ready()
            asyncio.run(one_round(server, prompts_for(-1, 2), 8))  # warm-up
        runs = {server.name: [] for server in servers}
        for round_no in range(args.repeats):
            prompts = prompts_for(round_no, args.clients)
            for server in servers:
                tps, ttfts = asyncio.run(one_round(server, prompts, args.max_tokens))
                runs[server.name].append((tps, statistics.median(ttfts), percentile(ttfts, 99)))
                print(f"  round {round_no} {server.name:<26}{tps:>8.1f} tok/s  TTFT p50 "
                      f"{statistics.median(ttfts) * 1e3:.0f} ms", flush=True)
    finally:
        for server in servers:
            server.stop()

    best = {name: max(r, key=lambda row: row[0]) for name, r in runs.items()}
    print(f"model {args.gguf.name}  clients {args.clients}  max_tokens {args.max_tokens}  threads {args.threads}  "
          f"best of {args.repeats} rounds (by tok/s)")
    print(f"{'server':<28}{'tok/s':>8}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for name, (tps, p50, p99) in best.items():
        print(f"{name:<28}{tps:>8.1f}{p50 * 1e3:>13.0f}{p99 * 1e3:>13.0f}")
    for ours in (name for name in best if name.startswith("nanoinfer")):
        for base in (name for name in best if not name.startswith("nanoinfer")):
            print(f"{ours} / {base}: tok/s {best[ours][0] / best[base][0]:.2f}x (goal >= 1.0), "
                  f"TTFT p50 {best[ours][1] / best[base][1]:.2f}x (goal <= 1.0)")

if __name__ == "__main__":
    main()
