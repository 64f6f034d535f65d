"""Prometheus metrics for the server: engine gauges read at scrape time, latency histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runtime.engine import AsyncEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class _EngineCollector:
    """Reads the engine's last reported counts on every scrape (nothing to keep in sync)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        gauges = [("nanoinfer_requests_running", "Requests holding KV blocks", s["running"]),
                  ("nanoinfer_requests_waiting", "Requests queued for their first step", s["waiting"]),
                  ("nanoinfer_requests_swapped", "Requests preempted to host memory", s["swapped"]),
                  ("nanoinfer_kv_blocks_used", "KV cache blocks in use", s["total_blocks"] - s["free_blocks"]),
                  ("nanoinfer_kv_blocks_total", "KV cache blocks in the pool", s["total_blocks"]),
                  ("nanoinfer_healthy", "1 while the engine is healthy", int(s["healthy"]))]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("nanoinfer_preemptions", "Sequences preempted", value=s["num_preemptions"])
        yield CounterMetricFamily("nanoinfer_generated_tokens", "Tokens generated", value=s["generated_tokens"])


class ServerMetrics:
    """One registry per app: no process-global state, several apps per process are fine."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("nanoinfer_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("nanoinfer_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
