"""Prometheus metrics with vLLM-style names (`csmserve:<name>`), in a registry per app."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


_PREFIX_COUNTERS = {  # PrefixCache.stats key -> help
    "hits": "Admissions that reused a cached prompt prefix (voice / conversation).",
    "misses": "Admissions with a prefix that found none of it cached.",
    "hit_positions": "Prompt positions not prefilled thanks to the prefix cache.",
    "stores": "Prompt prefixes stored in the prefix cache.",
    "evictions": "Prompt prefixes evicted from the prefix cache (LRU by bytes).",
}


class _PrefixCacheCollector:
    """The engine's PrefixCache.stats as counters, read at each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], dict]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self):
        stats = self.stats() or {}
        for key, help_ in _PREFIX_COUNTERS.items():
            c = CounterMetricFamily(f"csmserve:prefix_cache_{key}", help_, labels=["model_name"])
            c.add_metric([self.model_name], float(stats.get(key, 0)))
            yield c


class Metrics:
    def __init__(self, model_name: str, running: Callable[[], float], waiting: Callable[[], float],
                 prefix_stats: Callable[[], dict] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.ttfa = Histogram("csmserve:time_to_first_audio_seconds",
                              "Request arrival to its first audio chunk.", labels, registry=r,
                              buckets=_LATENCY_BUCKETS).labels(model_name)
        self.rtf = Histogram("csmserve:real_time_factor",
                             "Generation wall time / seconds of audio generated (< 1: faster than real time).",
                             labels, registry=r, buckets=_RTF_BUCKETS).labels(model_name)
        self.queue_time = Histogram("csmserve:request_queue_time_seconds",
                                    "Engine submit to admission into a slot (upper bound: to the first chunk).",
                                    labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model_name)
        self.e2e = Histogram("csmserve:e2e_request_latency_seconds", "Request arrival to its last chunk.",
                             labels, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        self.frames = Counter("csmserve:generated_frames", "80 ms Mimi frames generated.",
                              labels, registry=r).labels(model_name)
        self.audio_seconds = Counter("csmserve:generated_audio_seconds", "Seconds of audio generated.",
                                     labels, registry=r).labels(model_name)
        self.requests = Counter("csmserve:request_success", "Finished generations by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.errors = Counter("csmserve:request_errors", "Requests answered with an error, by status.",
                              labels + ["status"], registry=r)
        self._model_name = model_name
        Gauge("csmserve:num_requests_running", "Requests holding an engine slot.", labels,
              registry=r).labels(model_name).set_function(running)
        Gauge("csmserve:num_requests_waiting", "Requests queued for a slot.", labels,
              registry=r).labels(model_name).set_function(waiting)
        if prefix_stats is not None:
            r.register(_PrefixCacheCollector(model_name, prefix_stats))

    def finished(self, reason: str) -> None:
        self.requests.labels(self._model_name, reason).inc()

    def error(self, status: int) -> None:
        self.errors.labels(self._model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
