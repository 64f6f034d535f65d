"""Prometheus metrics for the server: engine gauges read at scrape time, latency histograms."""

from __future__ import annotations

import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from runtime.async_engine import AsyncEngine, RequestHandle

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# Inter-token gaps, finer where a loaded server's p99 falls (20-50 ms: a 40 ms goal needs a bound at 40)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


# (as vLLM's num_requests_*, the requests gauges count sequences: a request with n completions counts n)
GAUGES = (("nanoinfer_requests_running", "Sequences holding KV blocks", lambda s: s["running"]),
          ("nanoinfer_requests_waiting", "Sequences queued for a step", lambda s: s["waiting"]),
          ("nanoinfer_requests_swapped", "Sequences preempted to host memory", lambda s: s["swapped"]),
          ("nanoinfer_kv_blocks_used", "KV cache blocks in use", lambda s: s["total_blocks"] - s["free_blocks"]),
          ("nanoinfer_kv_blocks_total", "KV cache blocks in the pool", lambda s: s["total_blocks"]),
          ("nanoinfer_healthy", "1 while the engine is healthy", lambda s: int(s["healthy"])))
COUNTERS = (("nanoinfer_preemptions", "Sequences preempted", "num_preemptions"),
            ("nanoinfer_generated_tokens", "Tokens generated", "generated_tokens"),
            ("nanoinfer_engine_steps", "Engine steps run (generated tokens per step: the batch's use)", "steps"),
            ("nanoinfer_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
            ("nanoinfer_prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
            ("nanoinfer_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding)",
             "spec_draft_tokens"),
            ("nanoinfer_spec_decode_accepted_tokens", "Draft tokens accepted by verification (speculative decoding)",
             "spec_accepted_tokens"))


class _EngineCollector:
    """Reads the engine's last reported counts on every scrape (nothing to keep in sync). With data
    parallelism (stats() has `replicas`), each series once per replica, labelled replica="<i>"."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        replicas = s.get("replicas")
        if replicas is not None and len(replicas) == 1:  # (one engine process: the series as one engine's)
            s, replicas = {**replicas[0], "healthy": s["healthy"]}, None
        labels = [] if replicas is None else ["replica"]
        series = [([], s)] if replicas is None else [([str(i)], r) for i, r in enumerate(replicas)]
        for name, doc, value_of in GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for values, stats in series:
                family.add_metric(values, value_of(stats))
            yield family
        for name, doc, key in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for values, stats in series:
                family.add_metric(values, stats[key])
            yield family


class BulkHistogram:
    """A Prometheus histogram filled with many values at once: a request's inter-token gaps at its end. One
    `Histogram.observe` a token cost ~1.6 µs (a lock and a bucket search in Python), a tenth of a server front's
    time a token (bench/RESULTS.md, issue 60); here a request's gaps are binned in one numpy call. Exposed as
    prometheus_client's Histogram exposes one (buckets `le` each bound and +Inf, cumulative; count; sum)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # (the last: past every bound)
        self.sum = 0.0

    def observe_many(self, values) -> None:
        if len(values):
            v = np.asarray(values, dtype=np.float64)
            # (a value on a bound belongs to that bound's bucket: le, less or equal)
            self.counts += np.bincount(np.searchsorted(self.bounds, v, side="left"), minlength=len(self.counts))
            self.sum += float(v.sum())

    def collect(self):
        cumulative = np.cumsum(self.counts).tolist()
        labels = [_le(b) for b in self.bounds.tolist()] + ["+Inf"]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=list(zip(labels, cumulative)),
                                    sum_value=self.sum)


def _le(bound: float) -> str:
    return repr(float(bound))  # (as prometheus_client writes a bucket's bound)


class ServerMetrics:
    """One registry per app: no process-global state, several apps per process are fine."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("nanoinfer_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = BulkHistogram("nanoinfer_inter_token_latency_seconds", "Time between a request's tokens",
                                 ITL_BUCKETS)
        self.registry.register(self.itl)
        self.e2e = Histogram("nanoinfer_e2e_request_latency_seconds", "Request arrival to its end",
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.queue = Histogram("nanoinfer_request_queue_time_seconds", "Request arrival to its first step",
                               buckets=E2E_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("nanoinfer_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.requests = Counter("nanoinfer_requests", "Finished requests (completions) by finish reason",
                                ["finish_reason"], registry=self.registry)

    def observe(self, request: RequestHandle) -> None:
        """Account for a request that has ended."""
        end = request.finished_at or time.monotonic()
        if request.first_token_at is not None:
            self.ttft.observe(request.first_token_at - request.arrival)
        self.itl.observe_many(request.token_gaps)
        self.e2e.observe(end - request.arrival)
        if request.scheduled_at is not None:
            self.queue.observe(max(0.0, request.scheduled_at - request.arrival))
        self.prompt_tokens.inc(len(request.prompt_ids))
        for reason in request.finish_reasons:
            self.requests.labels(finish_reason=reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
