"""Prometheus metrics of the server: the engine's own gauges and counters, read at scrape time, plus
what only the HTTP layer sees (outcomes per request, time to first token, inter-token latency)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from decoderlm.serve.text import Timing

# engine.stats() key -> (metric name, help)
GAUGES = {
    "running": ("requests_running", "sequences being generated"),
    "waiting": ("requests_waiting", "sequences waiting for blocks"),
    "kv_blocks_used": ("kv_blocks_used", "KV-cache blocks in use"),
    "kv_blocks_free": ("kv_blocks_free", "KV-cache blocks free"),
    "kv_blocks_total": ("kv_blocks_total", "KV-cache blocks in the pool"),
}
COUNTERS = {
    "prompt_tokens": "prompt tokens admitted",
    "generated_tokens": "tokens generated (including aborted sequences)",
    "preemptions": "sequences preempted for lack of blocks",
    "prefix_cache_hits": "prompt tokens served from the prefix cache",
    "prefix_cache_queries": "prompt tokens looked up in the prefix cache",
}
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)  # seconds


class EngineCollector:
    """Engine gauges and counters, read from engine.stats() at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(f"decoderlm_{name}", doc, value=s[key])
        rate = s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0
        yield GaugeMetricFamily("decoderlm_prefix_cache_hit_rate", "prefix-cache hits / lookups, in prompt tokens", value=rate)
        for key, doc in COUNTERS.items():
            yield CounterMetricFamily(f"decoderlm_{key}", doc, value=s[key])


@dataclass
class Metrics:
    """The HTTP layer's own series, in a registry of their own (one per app, so tests can run several)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("decoderlm_http_requests", "generation requests by outcome: ok, aborted (client left), rejected (4xx)",
                                ["outcome"], registry=r)
        self.finished = Counter("decoderlm_sequences_finished", "sequences (choices) by finish reason", ["reason"], registry=r)
        self.completion_tokens = Counter("decoderlm_completion_tokens", "tokens generated for sequences that finished", registry=r)
        self.ttft = Histogram("decoderlm_time_to_first_token_seconds", "request arrival to first token, per sequence",
                              buckets=BUCKETS, registry=r)
        self.itl = Histogram("decoderlm_inter_token_latency_seconds", "time between consecutive tokens of a sequence",
                             buckets=BUCKETS, registry=r)

    def observe(self, timing: Timing) -> None:
        if timing.ttft is not None:
            self.ttft.observe(timing.ttft)
        for gap in timing.gaps:
            self.itl.observe(gap)
