"""The server's own view: /metrics (Prometheus text) scraped before, during (every second) and after a
scenario -> its time-to-first-audio histogram over the scenario, the running/waiting gauges in the window,
frames/s in the window, errors and finish reasons, and any prefix-cache metric it exposes."""
from __future__ import annotations

import math
import re
import threading
import time

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
TTFA = "csmserve:time_to_first_audio_seconds"
RUNNING, WAITING = "csmserve:num_requests_running", "csmserve:num_requests_waiting"
FRAMES = "csmserve:generated_frames_total"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus exposition text -> {(name, sorted labels): value}."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        out[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = v
    return out


def total(s: Samples, name: str, **where: str) -> float:
    """Sum of `name` over the label sets that match `where`."""
    return sum(v for (n, labels), v in s.items() if n == name and all((k, w) in labels for k, w in where.items()))


def by_label(s: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in s.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def histogram_delta(before: Samples, after: Samples, name: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)] of `name`'s buckets, after - before, summed over other labels."""
    counts: dict[float, float] = {}
    for s, sign in ((after, 1.0), (before, -1.0)):
        for le, v in by_label(s, name + "_bucket", "le").items():
            bound = math.inf if le in ("+Inf", "Inf") else float(le)
            counts[bound] = counts.get(bound, 0.0) + sign * v
    return sorted(counts.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket; the top finite bound if in +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            width = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / width if width > 0 else 1.0)
        prev_bound, prev_count = bound, count
    return prev_bound


class Sampler:
    """Scrapes /metrics every `period` s on a thread; keeps (time.monotonic(), samples) pairs."""

    def __init__(self, url: str, period: float = 1.0) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, Samples]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def scrape(self) -> Samples | None:
        import httpx

        try:
            r = httpx.get(f"{self.url}/metrics", timeout=5)
        except httpx.HTTPError:
            return None
        return parse(r.text) if r.status_code == 200 else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            s = self.scrape()
            if s is not None:
                self.samples.append((t, s))
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t)))

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def summarize(before: Samples | None, after: Samples | None, samples: list[tuple[float, Samples]],
              t0: float, t1: float) -> dict | None:
    """The server's numbers for one scenario (None: it exposes no /metrics)."""
    if before is None or after is None:
        return None
    ttfa = histogram_delta(before, after, TTFA)
    inside = [(t, s) for t, s in samples if t0 <= t <= t1]
    running = [total(s, RUNNING) for _, s in inside]
    out: dict = {
        "ttfa_count": int(ttfa[-1][1]) if ttfa else 0,
        "ttfa_p50_ms": _ms(quantile(ttfa, 0.5)), "ttfa_p99_ms": _ms(quantile(ttfa, 0.99)),
        "running_max": max(running, default=None),
        "running_mean": round(sum(running) / len(running), 1) if running else None,
        "waiting_max": max((total(s, WAITING) for _, s in inside), default=None),
        "frames_per_s": None,
        "errors": _delta_by(before, after, "csmserve:request_errors_total", "status"),
        "finished": _delta_by(before, after, "csmserve:request_success_total", "finished_reason"),
        "prefix": {},
    }
    if len(inside) >= 2:
        (ta, a), (tb, b) = inside[0], inside[-1]
        if tb > ta:
            out["frames_per_s"] = round((total(b, FRAMES) - total(a, FRAMES)) / (tb - ta), 1)
    for (name, labels) in after:
        if "prefix" in name and not name.endswith(("_created", "_bucket")):
            key = name + ("{" + ",".join(f"{k}={v}" for k, v in labels if k != "model_name") + "}"
                          if any(k != "model_name" for k, _ in labels) else "")
            value = after[(name, labels)]
            if name.endswith(("_total", "_sum", "_count")):
                value -= before.get((name, labels), 0.0)
            out["prefix"][key] = value
    return out


def _delta_by(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    a, b = by_label(after, name, label), by_label(before, name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)
