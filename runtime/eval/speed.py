"""Throughput and latency of the engine on a synthetic workload, per batch size (`nanoinfer eval speed`).

For each batch size B, B requests of random token ids (`input_len` each, a fixed seed) ask
for `output_len` tokens (greedy, EOS ignored) all at once, streamed from the AsyncEngine in
this process. Output throughput = the batch's output tokens / its wall time; TTFT = a
request's submission to its first token; ITL = the gaps between its later tokens, a delta's
gap divided among the tokens it brought. Percentiles are nearest-rank. `plot` draws
throughput against batch size and the latency CDFs of the largest batch (matplotlib, the
`eval` extra).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import NamedTuple, Sequence

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams


class SpeedPoint(NamedTuple):
    batch: int
    output_tokens_per_s: float
    ttft_ms: dict  # {"p50", "p90", "p99"}
    itl_ms: dict
    ttfts: list  # every request's, ms (the CDF)
    itls: list  # every token gap, ms


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def _summary(values: Sequence[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


async def _one(engine, prompt: list[int], params: SamplingParams, ttfts: list, itls: list) -> int:
    start = last = time.perf_counter()
    tokens = 0
    async for delta in engine.stream(prompt, params):
        now, new = time.perf_counter(), len(delta.outputs[0].token_ids) if delta.outputs else 0
        if not new:
            continue
        if tokens == 0:
            ttfts.append(1e3 * (now - start))
            itls.extend([0.0] * (new - 1))  # (tokens that came with the first: no gap of their own)
        else:
            itls.extend([1e3 * (now - last) / new] * new)
        tokens, last = tokens + new, now
    return tokens


async def measure(engine, batch_sizes: Sequence[int], input_len: int, output_len: int, vocab_size: int,
                  seed: int = 0) -> list[SpeedPoint]:
    """One SpeedPoint per batch size, in order (after a one-request warm-up)."""
    if not batch_sizes or min(batch_sizes) < 1 or input_len < 1 or output_len < 1:
        raise RequestError(f"batch sizes {list(batch_sizes)}, input_len={input_len} and output_len={output_len}: "
                           f"expected positive numbers", param="batch_sizes")
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    await _one(engine, [rng.randrange(vocab_size) for _ in range(input_len)], params, [], [])
    points = []
    for batch in batch_sizes:
        prompts = [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch)]
        ttfts, itls = [], []
        start = time.perf_counter()
        tokens = await asyncio.gather(*(_one(engine, p, params, ttfts, itls) for p in prompts))
        seconds = time.perf_counter() - start
        points.append(SpeedPoint(batch, sum(tokens) / seconds, _summary(ttfts), _summary(itls), ttfts, itls))
    return points


def plot(points: Sequence[SpeedPoint], path: str) -> None:
    """Throughput against batch size, and the largest batch's TTFT and ITL CDFs, as a PNG."""
    from runtime.eval.plots import cdf, pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    batches = [p.batch for p in points]
    left.plot(batches, [p.output_tokens_per_s for p in points], marker="o")
    left.set(xlabel="batch size (concurrent requests)", ylabel="output tokens / s", title="throughput")
    left.set_xscale("log", base=2)
    left.set_xticks(batches, [str(b) for b in batches])
    last = points[-1]
    # (tokens that came with the first have no gap: cdf leaves their 0 out)
    cdf(right, {"TTFT": last.ttfts, "ITL": last.itls}, f"latency CDF at batch {last.batch}")
    save(fig, path)
    plt.close(fig)
