"""The server's Prometheus metrics: the inter-token histogram filled a request at a time against prometheus_client's
own Histogram observing the same values one by one (its reference)."""

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from runtime.serve.metrics import ITL_BUCKETS, BulkHistogram


def exposition(registry) -> dict[str, float]:
    """Each sample line's value by its name and labels (prometheus_client's `_created` timestamps left out)."""
    lines = generate_latest(registry).decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line and not line.startswith("#") and "_created" not in line}


def test_bulk_histogram_exposes_what_one_observe_a_value_does():
    rng = random.Random(0)
    # values on the bounds (a bound's own bucket: le), past the last one, zero, and a spread in between
    values = [rng.choice(ITL_BUCKETS) for _ in range(50)] + [rng.expovariate(20) for _ in range(500)] + [99.0, 0.0]
    reference, bulk = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("x_seconds", "gaps", buckets=ITL_BUCKETS, registry=reference)
    for v in values:
        histogram.observe(v)
    fast = BulkHistogram("x_seconds", "gaps", ITL_BUCKETS)
    bulk.register(fast)
    for start in range(0, len(values), 97):  # (as requests end: a request's gaps at a time, some requests none)
        fast.observe_many(values[start:start + 97])
        fast.observe_many([])
    want, got = exposition(reference), exposition(bulk)
    assert want.keys() == got.keys() and len(want) == len(ITL_BUCKETS) + 3  # (buckets with +Inf, count, sum)
    for name, value in want.items():
        assert got[name] == value if not name.endswith("_sum") else abs(got[name] - value) <= 1e-9 * value
    assert got['x_seconds_bucket{le="+Inf"}'] == len(values) and got['x_seconds_bucket{le="0.05"}'] > 0
