"""What a scenario measured: the clients' records and the server's own view -> numbers (a dict for JSON) -> a row
of the markdown table (and, for several setups, a table side by side).

Counted = sent inside the measured window (burst: every arrival). Over the counted requests: TTFA (request
sent -> first audio; WebSocket: flush sent -> first binary audio), per-stream audio rate (seconds of audio per
wall second after the first audio; p1 = the slowest streams), and how many complete streams would have run dry
with a 100 ms / 300 ms jitter buffer (users.Playback). requests/s = requests that ended well inside the window /
its length (burst: all that ended well, over the time from the first arrival to the last end). Errors are counted
by status over every request. The server's view: its /metrics scraped before, during (every second) and after.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import Counter

from csmserve.apps.bench.serve.users import RECORD, Scenario, ran_dry

BUFFERS_S = (0.1, 0.3)
I = {name: i for i, name in enumerate(RECORD)}  # noqa: E741 - a record's column indexes
TTFA = "csmserve:time_to_first_audio_seconds"
RUNNING, WAITING = "csmserve:num_requests_running", "csmserve:num_requests_waiting"
FRAMES = "csmserve:generated_frames_total"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def pct(xs: list[float], q: float) -> float | None:
    """Percentile by linear interpolation (numpy's default), without numpy."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def r_(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def f_(x, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


# ---------------------------------------------------------------- the server's /metrics
def parse(text: str) -> Samples:
    """Prometheus exposition text -> {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(text) for x in family.samples}


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
            return parse(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):  # (no /metrics there, or not Prometheus text)
            return None

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


def server_summary(before: Samples | None, after: Samples | None, samples: list[tuple[float, Samples]],
              t0: float, t1: float) -> dict | None:
    """The server's numbers for one scenario (None: it exposes no /metrics)."""
    if before is None or after is None:
        return None
    ttfa = histogram_delta(before, after, TTFA)
    inside = [(t, s) for t, s in samples if t0 <= t <= t1]
    running = [total(s, RUNNING) for _, s in inside]
    out: dict = {
        "ttfa_count": int(ttfa[-1][1]) if ttfa else 0,
        "ttfa_p50_ms": ms(quantile(ttfa, 0.5)), "ttfa_p99_ms": ms(quantile(ttfa, 0.99)),
        "running_max": max(running, default=None),
        "running_mean": round(sum(running) / len(running), 1) if running else None,
        "waiting_max": max((total(s, WAITING) for _, s in inside), default=None),
        "frames_per_s": None,
        "errors": delta_by(before, after, "csmserve:request_errors_total", "status"),
        "finished": delta_by(before, after, "csmserve:request_success_total", "finished_reason"),
        # requests per LoRA adapter (its own counter, the engine's) during the scenario
        "lora_requests": delta_by(before, after, "csmserve:lora_requests_total", "adapter"),
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


def delta_by(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    a, b = by_label(after, name, label), by_label(before, name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


# ---------------------------------------------------------------- the clients' records
def ttfa_ms(records: list[list], qs: tuple[int, ...]) -> dict:
    """Over the records with a first audio: how many, TTFA percentiles and max, ms."""
    xs = [(r[I["t_first"]] - r[I["t_send"]]) * 1e3 for r in records if r[I["t_first"]] is not None]
    return {"n": len(xs)} | {f"p{q}": r_(pct(xs, q)) for q in qs} | {"max": r_(max(xs, default=None))}


def summarize(sc: Scenario, records: list[list], t_start: float, workers: list[dict],
              server: dict | None) -> dict:
    t0, t1 = sc.window(t_start)
    counted = [r for r in records if r[I["counted"]]]
    ok = [r for r in counted if r[I["status"]] == "ok"]
    rates = []
    for r in ok:
        span = r[I["t_end"]] - r[I["t_first"]] if r[I["t_first"]] is not None else 0
        if r[I["t_first"]] is not None and span > 0 and r[I["audio_s"]] > r[I["first_audio_s"]]:
            rates.append((r[I["audio_s"]] - r[I["first_audio_s"]]) / span)
    if sc.mode == "burst":
        ends = [r[I["t_end"]] for r in ok]
        span = (max(ends) - t_start) if ends else 0.0
        per_s = len(ok) / span if span > 0 else None
    else:
        per_s = sum(1 for r in records if r[I["status"]] == "ok" and t0 <= r[I["t_end"]] < t1) / sc.duration
    errors = Counter(r[I["status"]] for r in records if r[I["status"]] not in ("ok", "cut"))
    cut = sum(1 for r in counted if r[I["status"]] == "cut")
    cpu = [w["cpu_s"] / w["wall_s"] for w in workers if w.get("wall_s")]
    lag99 = [w["lag_ms"]["p99"] for w in workers if w["lag_ms"]["p99"] is not None]
    lagmax = [w["lag_ms"]["max"] for w in workers if w["lag_ms"]["max"] is not None]
    return {
        "name": sc.name, "scenario": dataclasses.asdict(sc),
        "t_start": t_start, "window": [round(t0 - t_start, 3), round(t1 - t_start, 3)],
        "requests": {"counted": len(counted), "ok": len(ok), "cut": cut, "all": len(records),
                     "per_s": r_(per_s, 2)},
        "ttfa_ms": ttfa_ms(counted, (50, 90, 99)),
        "audio_rate": {"p1": r_(pct(rates, 1), 2), "p50": r_(pct(rates, 50), 2)},
        "audio_s_mean": r_(sum(r[I["audio_s"]] for r in ok) / len(ok), 2) if ok else None,
        "dry": {f"{int(b * 1e3)}ms": sum(ran_dry(r[I["worst_lag"]], b) for r in ok) for b in BUFFERS_S}
        | {"of": len(ok)},
        "errors": dict(errors.most_common()),
        "clients": {"procs": len(workers), "cpu_per_proc_max": r_(max(cpu, default=None), 2),
                    "cpu_per_proc_mean": r_(sum(cpu) / len(cpu), 2) if cpu else None,
                    "loop_lag_p99_ms": r_(max(lag99, default=None)), "loop_lag_max_ms": r_(max(lagmax, default=None)),
                    "user_errors": [e for w in workers for e in w.get("user_errors", [])][:5]},
        "server": server,
    }


HEADER = ("| scenario | requests/s | TTFA p50 / p99 (ms) | audio rate p1 / p50 (x real time) | "
          "dry 100 ms | dry 300 ms | errors | server TTFA p50 / p99 (ms) | running mean / max | "
          "client CPU max, loop lag p99 (ms) |\n|---|---|---|---|---|---|---|---|---|---|")


def _errors(s: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"


def row(s: dict) -> str:
    t, a, d, c, srv = s["ttfa_ms"], s["audio_rate"], s["dry"], s["clients"], s["server"] or {}
    errors = _errors(s)
    if s["requests"]["cut"]:
        errors += f"; {s['requests']['cut']} cut"
    return (f"| {s['name']} | {f_(s['requests']['per_s'], '{:.1f}')} | {f_(t['p50'])} / {f_(t['p99'])} | "
            f"{f_(a['p1'], '{:.2f}')} / {f_(a['p50'], '{:.2f}')} | {d['100ms']} of {d['of']} | "
            f"{d['300ms']} of {d['of']} | {errors} | {f_(srv.get('ttfa_p50_ms'))} / {f_(srv.get('ttfa_p99_ms'))} | "
            f"{f_(srv.get('running_mean'))} / {f_(srv.get('running_max'))} | "
            f"{f_(c['cpu_per_proc_max'], '{:.2f}')}, {f_(c['loop_lag_p99_ms'])} |")


def details(s: dict) -> str:
    """The lines under the table for one scenario: what does not fit a cell."""
    srv = s["server"] or {}
    parts = [f"{s['name']}: {s['requests']['counted']} counted of {s['requests']['all']} requests, "
             f"{s['requests']['ok']} ok, TTFA p90 {f_(s['ttfa_ms']['p90'])} ms, max {f_(s['ttfa_ms']['max'])} ms, "
             f"mean audio {f_(s['audio_s_mean'], '{:.2f}')} s"]
    if srv:
        parts.append(f"server: {srv.get('ttfa_count')} first audios, {f_(srv.get('frames_per_s'))} frames/s in the "
                     f"window, waiting max {f_(srv.get('waiting_max'))}, finished {srv.get('finished')}, "
                     f"errors {srv.get('errors') or 0}" + (f", prefix {srv['prefix']}" if srv.get("prefix") else ""))
    if srv.get("cpu"):
        c = srv["cpu"]
        parts.append(f"server CPU (cores, over the window): engine process {c['engine']}, {c['workers_n']} API "
                     f"workers {c['workers']} (busiest {f_(c['worker_max'], '{:.2f}')}, least "
                     f"{f_(c['worker_min'], '{:.2f}')}), other {c['other']}")
    if s["clients"]["user_errors"]:
        parts.append(f"client errors: {s['clients']['user_errors']}")
    return "; ".join(parts)


def _cores(s: dict) -> float | None:
    cpu = (s.get("server") or {}).get("cpu")
    return None if not cpu else cpu["engine"] + cpu["workers"] + cpu["other"]


def table(results: list[tuple[str, list[dict]]]) -> list[str]:
    """Per scenario, a row per setup: its numbers and requests/s against the first setup's."""
    lines = ["| scenario | setup | requests/s | x first | TTFA p50 / p99 (ms) | dry 100 / 300 ms | errors | "
             "server CPU (cores) | server CPU ms per s of audio |", "|---|---|---|---|---|---|---|---|---|"]
    base = {s["name"]: s for s in results[0][1]}
    for i, sc in enumerate(results[0][1]):
        for name, scenarios in results:
            s = scenarios[i]
            per_s, first = s["requests"]["per_s"], base[sc["name"]]["requests"]["per_s"]
            ratio = f"{per_s / first:.2f}" if per_s and first else "-"
            cores = _cores(s)
            audio_per_s = (per_s or 0) * (s["audio_s_mean"] or 0)
            per_audio = 1e3 * cores / audio_per_s if cores is not None and audio_per_s else None
            lines.append(f"| {s['name']} | {name} | {f_(per_s, '{:.1f}')} | {ratio} | {f_(s['ttfa_ms']['p50'])} / "
                         f"{f_(s['ttfa_ms']['p99'])} | {s['dry']['100ms']} / {s['dry']['300ms']} of {s['dry']['of']} | "
                         f"{_errors(s)} | {f_(cores, '{:.2f}')} | {f_(per_audio)} |")
    return lines
