"""Prometheus metrics with vLLM-style names (`csmserve:<name>`), in a registry per app.

Request metrics are kept by the API worker that served the request; with several workers (PROMETHEUS_MULTIPROC_DIR)
prometheus_client's multiprocess mode sums them, so /metrics on any worker answers for the whole server. The
engine's own numbers come from the engine itself (`stats()`: engine.outputs.EngineStats).
"""
from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """The engine's gauges and counters, read at scrape time, and a series per adapter served now (`adapters`:
    name -> info; at most --max-cpu-loras, so the label's values are bounded)."""

    def __init__(self, model_name: str, stats: Callable[[], object | None]) -> None:
        self.model_name, self.stats = model_name, stats
        self.adapters: dict[str, dict] = {}

    def collect(self):
        yield from self._engine()
        yield from self._adapters()

    def _adapters(self):
        rows = [("lora_requests", "Requests for the adapter since it was loaded.", "requests", CounterMetricFamily),
                ("lora_generated_frames", "80 ms frames generated with the adapter.", "frames", CounterMetricFamily),
                ("lora_loads", "Copies of the adapter into a GPU pool slot (LRU: again after an eviction).", "loads",
                 CounterMetricFamily),
                ("lora_load_seconds", "Seconds its copies into the pool took (queued to done).", "load_s",
                 CounterMetricFamily),
                ("lora_requests_running", "Admitted requests with the adapter.", "running", GaugeMetricFamily),
                ("lora_requests_waiting", "Queued requests with the adapter (some waiting for a pool slot).",
                 "queued", GaugeMetricFamily),
                ("lora_resident", "1 while the adapter sits in a GPU pool slot.", "resident", GaugeMetricFamily)]
        adapters = self.adapters
        loaded = GaugeMetricFamily("csmserve:lora_adapters_loaded", "LoRA adapters served (loaded by name).",
                                   labels=["model_name"])
        loaded.add_metric([self.model_name], float(len(adapters)))
        yield loaded
        for name, doc, key, family in rows:
            m = family(f"csmserve:{name}", doc, labels=["model_name", "adapter"])
            for adapter, info in sorted(adapters.items()):
                m.add_metric([self.model_name, adapter], float(info.get(key) or 0))
            yield m

    def _engine(self):
        s = self.stats()
        rows = [("num_requests_running", "Requests holding an engine slot (generating, prefilling or waiting for "
                 "their next text).", None if s is None else s.running + s.idle, GaugeMetricFamily),
                ("num_requests_waiting", "Requests queued for a slot.", None if s is None else s.waiting,
                 GaugeMetricFamily),
                ("prefix_cache_hits", "Admissions that reused a cached prompt prefix (voice, conversation).",
                 None if s is None else s.prefix_hits, CounterMetricFamily),
                ("prefix_cache_misses", "Admissions with a prefix that found none of it cached.",
                 None if s is None else s.prefix_misses, CounterMetricFamily),
                ("prefix_cache_hit_positions", "Prompt positions whose prefill a cached prefix saved.",
                 None if s is None else s.prefix_hit_positions, CounterMetricFamily),
                ("prefix_cache_stores", "Prompt prefixes stored in the prefix cache.",
                 None if s is None else s.prefix_stores, CounterMetricFamily),
                ("prefix_cache_evictions", "Prompt prefixes evicted from the prefix cache (LRU by bytes).",
                 None if s is None else s.prefix_evictions, CounterMetricFamily),
                ("engine_reader_waits", "Engine steps that waited for an API worker to read the previous "
                 "results (a busy worker; --reader-wait-s).", None if s is None else s.reader_waits, CounterMetricFamily),
                ("engine_reader_wait_seconds", "Seconds the engine waited for API workers to read its results.",
                 None if s is None else s.reader_wait_s, CounterMetricFamily)]
        for name, doc, value, family in rows:
            m = family(f"csmserve:{name}", doc, labels=["model_name"])
            m.add_metric([self.model_name], float(value or 0))
            yield m


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], object | None]) -> None:
        self.registry = r = CollectorRegistry()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
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
        self._engine = _EngineCollector(model_name, stats)
        if not self.multiprocess:
            r.register(self._engine)

    def finished(self, reason: str) -> None:
        self.requests.labels(self._model_name, reason).inc()

    def error(self, status: int) -> None:
        self.errors.labels(self._model_name, str(status)).inc()

    def render(self, adapters: dict[str, dict] | None = None) -> bytes:
        """The Prometheus text; adapters: the engine's adapters now (name -> info: their series)."""
        self._engine.adapters = adapters or {}
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        r.register(self._engine)
        return generate_latest(r)
