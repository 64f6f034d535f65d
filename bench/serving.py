"""Serving latency and throughput: N concurrent SSE clients against `nanoinfer serve`,
beside the offline engine (LLM.generate) on the same requests in the same run.

    python bench/serving.py [--model M] [--device cpu] [--clients 16] [--requests N] [--input-len 16 64]
                            [--output-len 32 32] [--num-blocks N] [--plot FILE.png]

Prompts are random token ids (fixed seed) sent to /v1/completions with ignore-free greedy
sampling; every request asks for its output length, and min-length is enforced by checking
the usage. TTFT = request sent to first content chunk; ITL = gaps between content chunks (as
vLLM's benchmark counts them: a chunk that carries several tokens is one gap). The server runs in
its own process (as in production); with --api-server-count N its fronts are N processes; with
--data-parallel-size N its N replicas are processes of their own (runtime/engine_process/data_parallel.py). DP=1 against
DP=2, two H100s, the small shape (DIR from `python bench/dummy_checkpoint.py qwen3-0.6b DIR`), in one lease:

    for dp in 1 2; do python bench/serving.py --model DIR --load-format dummy --device cuda --clients 64 \
        --requests 512 --input-len 100 1024 --output-len 100 1024 --idle-requests 2 --data-parallel-size $dp; done

With one request per client (no --requests) the run ends with the longest request decoding
alone, so its length bounds the run from below however many replicas serve it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx

from runtime.eval.speed import percentile


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux's /proc; None elsewhere)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (the server's engine processes and their ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


ENGINE_COUNTERS = ("nanoinfer_engine_steps_total", "nanoinfer_preemptions_total", "nanoinfer_generated_tokens_total")


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step, preemption and token counts from /metrics (summed over replicas), and its KV blocks."""
    totals = dict.fromkeys((*ENGINE_COUNTERS, "nanoinfer_kv_blocks_total"), 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def is_api_server(pid: int) -> bool:
    """Whether `pid` is one of a server's other HTTP fronts (runtime/serve/api_servers.py)."""
    try:
        return b"runtime.serve.api_servers" in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def cpu_of(pids) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in pids)


LONG_GAPS: list[tuple[float, float]] = []  # (time.monotonic() at its end, seconds) of chunk gaps over 100 ms
# The gaps before chunks whose text has no U+FFFD: a chunk that has one ends bytes the detokenizer held back until
# they made text, or until the stream's end (random weights sample byte tokens that never do): its gap is the
# hold-back's, not the server's latency.
WHOLE_TEXT_ITLS: list[float] = []


# --token-chunks: each token's logprob asked for (`logprobs` 0), so a step's token comes in a chunk even while its
# text is held back, and the ITL times tokens rather than text (set in the environment: the client processes
# are spawned).
TOKEN_CHUNKS = "SERVING_TOKEN_CHUNKS"


async def one_client(http, url, prompt, max_tokens, ttfts, itls):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    per_token = os.environ.get(TOKEN_CHUNKS) == "1"
    if per_token:
        body["logprobs"] = 0
    start = time.perf_counter()
    last, tokens = None, 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and (chunk["choices"][0]["text"] or per_token and (
                    chunk["choices"][0].get("logprobs") or {}).get("tokens")):
                if last is None:
                    ttfts.append(now - start)
                else:
                    itls.append(now - last)
                    if "\ufffd" not in chunk["choices"][0]["text"]:
                        WHOLE_TEXT_ITLS.append(now - last)
                    if now - last > 0.1:  # (a long gap: when it ended, on the host's clock)
                        LONG_GAPS.append((time.monotonic(), now - last))
                last = now
    return tokens


async def idle_requests(url, prompts) -> list[float]:
    """An idle server's TTFT: `prompts` one at a time, 8 tokens each, on one kept-alive connection (as an
    SDK's client sends them; its first request, which opens the connection, is not counted)."""
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600) as http:
        await one_client(http, url, [1, 2, 3], 8, [], [])
        for prompt in prompts:
            await one_client(http, url, prompt, 8, ttfts, [])
    return ttfts


async def run_clients(url, prompts, outputs, concurrency=None):
    """Every (prompt, output length) as one streamed request, `concurrency` at a time (None: all at
    once): each client sends its next request as soon as its last one ends. The client's own garbage
    collector is off meanwhile: its full collections (50-110 ms with hundreds of streams' objects)
    would count as gaps between the server's chunks."""
    gc.collect()
    gc.disable()
    try:
        return await _run_clients(url, prompts, outputs, concurrency)
    finally:
        gc.enable()


async def _run_clients(url, prompts, outputs, concurrency):
    ttfts, itls = [], []
    work = iter(zip(prompts, outputs))

    async def client(http):
        return [await one_client(http, url, p, n, ttfts, itls) for p, n in work]

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(client(http) for _ in range(concurrency or len(prompts))))
        elapsed = time.perf_counter() - start
    return sum(map(sum, tokens)), elapsed, ttfts, itls


def _client_process(url, prompts, outputs, concurrency, results, ready, go):
    """One load-generating process's share of the clients (its own interpreter: one Python process parsing
    every SSE line of 256 streams would be the bottleneck, not the server). It starts when every process is
    ready (`go`): a process still importing would otherwise send its share seconds after the others."""
    ready.put(os.getpid())
    go.wait()
    cpu = time.process_time()
    tokens, _, ttfts, itls = asyncio.run(run_clients(url, prompts, outputs, concurrency))
    results.put((tokens, ttfts, itls, time.process_time() - cpu, LONG_GAPS, WHOLE_TEXT_ITLS))


def run_client_processes(url, prompts, outputs, concurrency, processes):
    """`run_clients` split over `processes` processes (request i to process i % processes); the same totals,
    with the client processes' own CPU seconds."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [(prompts[i::processes], outputs[i::processes], max(1, concurrency // processes))
              for i in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(url, *share, results, ready, go)) for share in shares]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get()
    start = time.perf_counter()
    go.set()
    parts = [results.get() for _ in procs]
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join()
    LONG_GAPS.extend(gap for p in parts for gap in p[4])
    WHOLE_TEXT_ITLS.extend(gap for p in parts for gap in p[5])
    return (sum(p[0] for p in parts), elapsed, [t for p in parts for t in p[1]], [t for p in parts for t in p[2]],
            sum(p[3] for p in parts))


def _histograms(url: str) -> dict[str, tuple[dict[str, float], float]]:
    """The server's histograms since it started: name -> ({bucket's upper bound: count at or below}, count)."""
    out: dict[str, tuple[dict[str, float], float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith("_bucket"):
            out.setdefault(name[:-7], ({}, 0.0))[0][line.split('le="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        elif name.endswith("_count") and name[:-6] in out:
            out[name[:-6]] = (out[name[:-6]][0], float(line.rsplit(" ", 1)[1]))
    return out


def _bound(buckets: dict[str, float], total: float, share: float) -> str:
    """The smallest bucket bound that `share` of the observations are at or below."""
    return next((le for le, n in buckets.items() if total and n / total >= share), "?")


def print_server_gaps(url: str) -> None:
    """The gaps between tokens as the server's front saw them (its ITL histogram, since it started): those over
    20 ms to 1 s — beside the clients' gaps, where a stall happens (the server, or the way to the client);
    and the front's own TTFT and queue time (from a request's admission: the clients' TTFT less these is the way
    in, through HTTP and admission, and out)."""
    histograms = _histograms(url)
    buckets, total = histograms.get("nanoinfer_inter_token_latency_seconds", ({}, 0.0))
    over = {le: total - n for le, n in buckets.items() if le in ("0.02", "0.03", "0.04", "0.05", "0.1", "0.2", "0.5", "1.0")}
    print(f"server-side token gaps: {total:.0f}, p99 <= {_bound(buckets, total, 0.99)} s; over " +
          ", ".join(f"{le} s: {n:.0f}" for le, n in over.items()))
    for name, what in (("nanoinfer_time_to_first_token_seconds", "TTFT"),
                       ("nanoinfer_request_queue_time_seconds", "queue time")):
        buckets, total = histograms.get(name, ({}, 0.0))
        print(f"server-side {what} since its start ({total:.0f} requests): p50 <= {_bound(buckets, total, 0.5)} s, "
              f"p99 <= {_bound(buckets, total, 0.99)} s")


def print_long_gaps(run_start: float) -> None:
    """The chunk gaps over 100 ms, by the 50 ms window their end fell in (seconds into the run): many streams'
    gaps ending together is a stall of the server (a long step, a collection), one stream's its own."""
    if not LONG_GAPS:
        return
    windows: dict[float, list[float]] = {}
    for end, gap in LONG_GAPS:
        windows.setdefault(round((end - run_start) / 0.05) * 0.05, []).append(gap)
    top = sorted(windows.items(), key=lambda w: -len(w[1]))[:12]
    print(f"chunk gaps over 100 ms: {len(LONG_GAPS)}; the busiest windows (s into the run: gaps, longest ms, "
          f"run start {run_start:.2f} on the host's monotonic clock): " +
          ", ".join(f"{t:.2f}: {len(g)}, {max(g) * 1e3:.0f}" for t, g in sorted(top)))


def start_profile(pid: int, seconds: float, path: str) -> subprocess.Popen:
    """py-spy sampling `pid`'s threads (active samples, collapsed stacks) for `seconds` into `path`
    (bench/profile_summary.py reads it)."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                             "--format", "raw", "--threads", "--subprocesses", "--nonblocking", "--output", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in all (default: one per client); each client sends its next as its last ends, "
                             "so that the run is not the longest request's own latency")
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 32))
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (bench/dummy_checkpoint.py)")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="the server's engine replicas (the "
                                                                           "offline baseline runs one engine)")
    parser.add_argument("--idle-requests", type=int, default=10, help="one at a time, for the idle server's TTFT")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="the TTFT and ITL CDFs")
    parser.add_argument("--client-processes", type=int, default=1, help="processes the clients are spread over")
    parser.add_argument("--profile", default=None, metavar="FILE.txt",
                        help="py-spy's collapsed stacks of the server's processes during the timed run")
    parser.add_argument("--profile-seconds", type=float, default=20.0)
    parser.add_argument("--profile-delay", type=float, default=0.0,
                        help="seconds into the timed run before sampling starts (past the clients' connecting "
                             "and the first prefills, into the steady decode)")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline baseline")
    parser.add_argument("--token-chunks", action="store_true", help="time the ITL between tokens, not text: each "
                        "token's logprob asked for, so held-back text still sends its token's chunk")
    parser.add_argument("--serve-args", default="", help="more flags for `nanoinfer serve`, as one string")
    args = parser.parse_args()
    if args.token_chunks:
        os.environ[TOKEN_CHUNKS] = "1"

    import random

    rng = random.Random(0)
    requests = args.requests or args.clients
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(*args.input_len))] for _ in range(requests)]
    outputs = [rng.randint(*args.output_len) for _ in range(requests)]
    # The idle server's requests: prompts of their own, so that neither the server nor the offline engine has
    # them cached from its warm-up or its run.
    idle = random.Random(1)
    idle_prompts = [[idle.randrange(100, 20000) for _ in range(idle.randint(*args.input_len))]
                    for _ in range(args.idle_requests)]
    # The warm-ups' too (the same lengths, other tokens): a timed prompt found in the prefix cache would make
    # its first token a step's work on either side, and the TTFT compared that of a cache hit.
    warm = random.Random(2)
    warm_prompts = [[warm.randrange(100, 20000) for _ in range(len(p))] for p in prompts[:max(2, args.clients)]]
    common = (["--model", args.model] if args.model else []) + ["--device", args.device, "--load-format",
                                                                 args.load_format] + \
        (["--num-blocks", str(args.num_blocks)] if args.num_blocks else [])
    common += ["--cuda-graph-capture", "all"]  # (no graph captured on first use in a timed request)

    served = ["--data-parallel-size", str(args.data_parallel_size)] if args.data_parallel_size > 1 else []
    server = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--port", "0", *common, *served,
                               *args.serve_args.split()], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://[\d.]+:\d+", server.stdout.readline()).group(0)
        asyncio.run(run_clients(url, warm_prompts[:2], [4, 4]))  # warm-up
        asyncio.run(run_clients(url, warm_prompts[:args.clients], [4] * args.clients))  # (prefill shapes, compiled)
        idle_ttfts = asyncio.run(idle_requests(url, idle_prompts))
        counters_before = engine_counters(url)
        below = descendants(server.pid)
        fronts = [server.pid, *(p for p in below if is_api_server(p))]  # (--api-server-count N: N front processes)
        engines = [p for p in below if p not in fronts]
        cpu_before, engines_before = cpu_of(fronts), cpu_of(engines)
        profiler = None
        if args.profile:
            profiler = threading.Timer(args.profile_delay, lambda: profilers.append(
                start_profile(server.pid, args.profile_seconds, args.profile)))
            profilers: list[subprocess.Popen] = []
            profiler.start()
        LONG_GAPS.clear()
        WHOLE_TEXT_ITLS.clear()
        run_start = time.monotonic()
        if args.client_processes > 1:
            tokens, elapsed, ttfts, itls, client_cpu = run_client_processes(url, prompts, outputs, args.clients,
                                                                            args.client_processes)
        else:
            client_start = time.process_time()
            tokens, elapsed, ttfts, itls = asyncio.run(run_clients(url, prompts, outputs, args.clients))
            client_cpu = time.process_time() - client_start
        cpu_after, engines_cpu = cpu_of(fronts), cpu_of(engines) - engines_before
        print_long_gaps(run_start)
        counters = {k: v - counters_before.get(k, 0) for k, v in engine_counters(url).items()}
        print_server_gaps(url)
        steps = counters["nanoinfer_engine_steps_total"]
        print(f"server engine: {steps:.0f} steps, {counters['nanoinfer_generated_tokens_total'] / max(steps, 1):.1f} "
              f"tokens a step, {counters['nanoinfer_preemptions_total']:.0f} preemptions, "
              f"{counters_before['nanoinfer_kv_blocks_total']:.0f} KV blocks")
        if profiler is not None:
            profiler.join()
            for spy in profilers:
                spy.wait()
                if spy.returncode:
                    print(f"py-spy failed: {spy.stderr.read()[-500:]}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(60)

    from nanoinfer import LLM, SamplingParams

    if args.no_offline:
        _report_served(args, requests, tokens, elapsed, ttfts, itls, idle_ttfts, cpu_before, cpu_after, client_cpu,
                       len(engines), engines_cpu)
        return
    # With more requests than clients, the offline engine keeps as many in flight as the clients do: the same load.
    in_flight = {"max_num_seqs": args.clients} if requests > args.clients else {}
    with LLM(args.model, device=args.device, progress=False, load_format=args.load_format, cuda_graph_capture="all",
             **({"num_blocks": args.num_blocks} if args.num_blocks else {}), **in_flight) as llm:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        llm.generate(warm_prompts, [SamplingParams(temperature=0, max_tokens=4)] * len(warm_prompts),
                     use_tqdm=False)  # warm-up
        idle_firsts = []  # the idle server's requests, offline: one at a time, to their first token
        for prompt in idle_prompts:
            first = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            idle_firsts.append(time.perf_counter() - first)
        # (LLM.generate's own steps, with the requests' states kept: their first tokens' times)
        states = [llm.engine.new_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
        start = time.perf_counter()
        before = llm.stats()
        results = llm._run(states)
        offline = time.perf_counter() - start
        offline_ttfts = [s.first_token_at - s.arrival for s in states]
        after = llm.stats()
        steps = after["steps"] - before["steps"]
        print(f"offline engine: {steps} steps, {(after['generated_tokens'] - before['generated_tokens']) / max(steps, 1):.1f} "
              f"tokens a step, {after['num_preemptions'] - before['num_preemptions']} preemptions, "
              f"{after['total_blocks']} KV blocks")
    offline_tokens = sum(len(r.token_ids) for r in results)

    _report_served(args, requests, tokens, elapsed, ttfts, itls, idle_ttfts, cpu_before, cpu_after, client_cpu,
                   len(engines), engines_cpu)
    offline_tps = offline_tokens / offline
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    if idle_ttfts:
        print(f"offline first token of the idle requests, one at a time: p50 {statistics.median(idle_firsts) * 1e3:.1f} "
              f"ms (the server's idle TTFT p50 {statistics.median(idle_ttfts) * 1e3:.1f} ms)")
    print(f"{'offline LLM.generate':<22}{offline_tokens:>8}{offline:>9.2f}{offline_tps:>9.1f}"
          f"{ms(statistics.median(offline_ttfts)) + '/' + ms(percentile(offline_ttfts, 99)):>18}")
    if requests <= args.clients:  # (every request sent at once on both sides: the same first tokens to wait for)
        print(f"server TTFT p50 is {statistics.median(ttfts) / statistics.median(offline_ttfts):.2f}x the offline "
              f"run's first token of the same requests (goal <= 1.2x)")
    print(f"server keeps {tokens / elapsed / offline_tps:.0%} of the offline tok/s (offline with "
          f"{min(requests, args.clients)} in flight; goal >= 95%, >= 90% at 64 streams)")


def _report_served(args, requests, tokens, elapsed, ttfts, itls, idle_ttfts, cpu_before, cpu_after, client_cpu,
                   num_engines, engines_cpu):
    served_tps = tokens / elapsed
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    print(f"clients {args.clients}  requests {requests}  input {args.input_len}  output {args.output_len}  "
          f"device {args.device}  "
          f"data_parallel_size {args.data_parallel_size}")
    print(f"{'':<22}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'TTFT p50/p99 ms':>18}{'ITL p50/p99 ms':>17}")
    print(f"{'server (SSE clients)':<22}{tokens:>8}{elapsed:>9.2f}{served_tps:>9.1f}"
          f"{ms(statistics.median(ttfts)) + '/' + ms(percentile(ttfts, 99)):>18}"
          f"{ms(statistics.median(itls)) + '/' + ms(percentile(itls, 99)):>17}")
    if WHOLE_TEXT_ITLS and len(WHOLE_TEXT_ITLS) < len(itls):
        print(f"  ITL p50/p99 of the {len(WHOLE_TEXT_ITLS)} of {len(itls)} chunks without held-back bytes (U+FFFD): "
              f"{ms(statistics.median(WHOLE_TEXT_ITLS))}/{ms(percentile(WHOLE_TEXT_ITLS, 99))} ms")
    if cpu_before is not None:  # (with data parallelism the server's process is the front alone)
        cpu = cpu_after - cpu_before
        print(f"server front processes CPU {cpu:.2f} s over the run: {cpu / elapsed:.0%} of a core, "
              f"{cpu / max(tokens, 1) * 1e6:.0f} us a token")
    if num_engines:
        print(f"engine processes ({num_engines}) CPU {engines_cpu:.2f} s: {engines_cpu / elapsed:.0%} of a core, "
              f"{engines_cpu / max(tokens, 1) * 1e6:.0f} us a token")
    print(f"client processes ({args.client_processes}) CPU {client_cpu:.2f} s: {client_cpu / elapsed:.0%} of a core")
    if idle_ttfts:  # (--idle-requests 0 asks for none)
        print(f"idle server TTFT p50 {ms(statistics.median(idle_ttfts))} ms over {len(idle_ttfts)} requests "
              f"(goal <= 50 ms)")
    if args.plot:
        from runtime.eval.plots import cdf, pyplot, save

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        to_ms = lambda values: [v * 1e3 for v in values]  # noqa: E731
        cdf(ax, {f"TTFT, {args.clients} clients": to_ms(ttfts), "TTFT, idle server": to_ms(idle_ttfts),
                 f"ITL, {args.clients} clients": to_ms(itls)}, f"served latency, {args.device}")
        save(fig, args.plot)
        plt.close(fig)


if __name__ == "__main__":
    main()
