"""Records of one scenario -> its numbers (a dict for JSON) -> a row of the markdown table.

Counted = sent inside the measured window (burst: every arrival). Over the counted requests:
TTFA (request sent -> first audio; WebSocket: flush sent -> first binary audio), per-stream audio rate
(seconds of audio per wall second after the first audio; p1 = the slowest streams), and how many
complete streams would have run dry with a 100 ms / 300 ms jitter buffer (playback.py).
requests/s = requests that ended well inside the window / its length (burst: all that ended well, over
the time from the first arrival to the last end). Errors are counted by status over every request.
"""
from __future__ import annotations

from collections import Counter

from csmserve.apps.bench.serve.playback import ran_dry
from csmserve.apps.bench.serve.scenario import Scenario
from csmserve.apps.bench.serve.users import RECORD

BUFFERS_S = (0.1, 0.3)
_I = {name: i for i, name in enumerate(RECORD)}


def _pct(xs: list[float], q: float) -> float | None:
    """Percentile by linear interpolation (numpy's default), without numpy."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def summarize(sc: Scenario, records: list[list], t_start: float, workers: list[dict],
              server: dict | None) -> dict:
    t0, t1 = sc.window(t_start)
    I = _I  # noqa: E741 - column indexes
    counted = [r for r in records if r[I["counted"]]]
    ok = [r for r in counted if r[I["status"]] == "ok"]
    first = [r for r in counted if r[I["t_first"]] is not None]
    ttfa = [(r[I["t_first"]] - r[I["t_send"]]) * 1e3 for r in first]
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
        "name": sc.name, "scenario": sc.to_dict(),
        "t_start": t_start, "window": [round(t0 - t_start, 3), round(t1 - t_start, 3)],
        "requests": {"counted": len(counted), "ok": len(ok), "cut": cut, "all": len(records),
                     "per_s": _r(per_s, 2)},
        "ttfa_ms": {"n": len(ttfa), "p50": _r(_pct(ttfa, 50)), "p90": _r(_pct(ttfa, 90)),
                    "p99": _r(_pct(ttfa, 99)), "max": _r(max(ttfa, default=None))},
        "audio_rate": {"p1": _r(_pct(rates, 1), 2), "p50": _r(_pct(rates, 50), 2)},
        "audio_s_mean": _r(sum(r[I["audio_s"]] for r in ok) / len(ok), 2) if ok else None,
        "dry": {f"{int(b * 1e3)}ms": sum(ran_dry(r[I["worst_lag"]], b) for r in ok) for b in BUFFERS_S}
        | {"of": len(ok)},
        "errors": dict(errors.most_common()),
        "clients": {"procs": len(workers), "cpu_per_proc_max": _r(max(cpu, default=None), 2),
                    "cpu_per_proc_mean": _r(sum(cpu) / len(cpu), 2) if cpu else None,
                    "loop_lag_p99_ms": _r(max(lag99, default=None)), "loop_lag_max_ms": _r(max(lagmax, default=None)),
                    "user_errors": [e for w in workers for e in w.get("user_errors", [])][:5]},
        "server": server,
    }


HEADER = ("| scenario | requests/s | TTFA p50 / p99 (ms) | audio rate p1 / p50 (x real time) | "
          "dry 100 ms | dry 300 ms | errors | server TTFA p50 / p99 (ms) | running mean / max | "
          "client CPU max, loop lag p99 (ms) |\n|---|---|---|---|---|---|---|---|---|---|")


def _f(x, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def row(s: dict) -> str:
    t, a, d, c, srv = s["ttfa_ms"], s["audio_rate"], s["dry"], s["clients"], s["server"] or {}
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "0"
    if s["requests"]["cut"]:
        errors += f"; {s['requests']['cut']} cut"
    return (f"| {s['name']} | {_f(s['requests']['per_s'], '{:.1f}')} | {_f(t['p50'])} / {_f(t['p99'])} | "
            f"{_f(a['p1'], '{:.2f}')} / {_f(a['p50'], '{:.2f}')} | {d['100ms']} of {d['of']} | "
            f"{d['300ms']} of {d['of']} | {errors} | {_f(srv.get('ttfa_p50_ms'))} / {_f(srv.get('ttfa_p99_ms'))} | "
            f"{_f(srv.get('running_mean'))} / {_f(srv.get('running_max'))} | "
            f"{_f(c['cpu_per_proc_max'], '{:.2f}')}, {_f(c['loop_lag_p99_ms'])} |")


def details(s: dict) -> str:
    """The lines under the table for one scenario: what does not fit a cell."""
    srv = s["server"] or {}
    parts = [f"{s['name']}: {s['requests']['counted']} counted of {s['requests']['all']} requests, "
             f"{s['requests']['ok']} ok, TTFA p90 {_f(s['ttfa_ms']['p90'])} ms, max {_f(s['ttfa_ms']['max'])} ms, "
             f"mean audio {_f(s['audio_s_mean'], '{:.2f}')} s"]
    if srv:
        parts.append(f"server: {srv.get('ttfa_count')} first audios, {_f(srv.get('frames_per_s'))} frames/s in the "
                     f"window, waiting max {_f(srv.get('waiting_max'))}, finished {srv.get('finished')}, "
                     f"errors {srv.get('errors') or 0}" + (f", prefix {srv['prefix']}" if srv.get("prefix") else ""))
    if srv.get("cpu"):
        c = srv["cpu"]
        parts.append(f"server CPU (cores, over the window): engine process {c['engine']}, {c['workers_n']} API workers "
                     f"{c['workers']} (busiest {_f(c['worker_max'], '{:.2f}')}, least {_f(c['worker_min'], '{:.2f}')}), "
                     f"other {c['other']}")
    if s["clients"]["user_errors"]:
        parts.append(f"client errors: {s['clients']['user_errors']}")
    return "; ".join(parts)
