"""The soak's records and samples -> its numbers (a dict for JSON) -> the markdown summary.

Records are soak_users.RECORD lists. TTFA: request sent -> first audio byte (HTTP speech read to its end,
`voice-use` included), flush sent -> first binary audio (WebSocket turns); per window of `window_s`
from the load's start. Memory: every server process's RSS (tree.py) and GPU memory sampled through the
run; `start` is the first sample after the ramp and a warm-up (allocators and caches filling: the engine's
RSS climbs for its first ~30 s on the CPU), `middle` the one nearest the midpoint of start..end, `end` the
last before the stop, `after` once the slots are free again; growth = end - start (and end - middle).
"""
from __future__ import annotations

from collections import Counter, defaultdict

from csmserve.apps.bench.serve.report import _pct
from csmserve.apps.bench.serve.soak_users import RECORD

_I = {name: i for i, name in enumerate(RECORD)}
SPEECH_KINDS = ("speech-", "voice-use")


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def _ttfa(records: list[list]) -> dict:
    xs = [(r[_I["t_first"]] - r[_I["t_send"]]) * 1e3 for r in records]
    return {"n": len(xs), "p50": _r(_pct(xs, 50)), "p99": _r(_pct(xs, 99)), "max": _r(max(xs, default=None))}


def _timed(records: list[list], ws: bool) -> list[list]:
    return [r for r in records if r[_I["status"]] == "ok" and r[_I["t_first"]] is not None
            and (r[_I["kind"]] == "ws-turn" if ws else r[_I["kind"]].startswith(SPEECH_KINDS))]


def _sent_in(records: list[list], start: float, end: float) -> list[list]:
    return [r for r in records if start <= r[_I["t_send"]] < end]


def ttfa_windows(records: list[list], t0: float, t1: float, window_s: float) -> list[dict]:
    http, ws = _timed(records, False), _timed(records, True)
    out, start = [], t0
    while start < t1 - 1e-9:
        end = start + window_s
        end = t1 if end > t1 or t1 - end < window_s / 3 else end  # a short tail joins the last window
        out.append({"from_s": round(start - t0, 1), "to_s": round(end - t0, 1),
                    "http": _ttfa(_sent_in(http, start, end)), "ws": _ttfa(_sent_in(ws, start, end))})
        start = end
    return out


def memory_points(samples: list[dict], warm_s: float, load_end: float) -> dict:
    """samples: {"t": s since the load's start, "phase": idle|load|after, "rss": {...}, "gpu": {...}|None}."""
    load = [s for s in samples if s["phase"] == "load"]
    warm = [s for s in load if s["t"] >= warm_s] or load
    points = {"idle": next((s for s in samples if s["phase"] == "idle"), None),
              "start": warm[0] if warm else None,
              "middle": min(warm, key=lambda s: abs(s["t"] - (warm[0]["t"] + load_end) / 2)) if warm else None,
              "end": warm[-1] if warm else None,
              "after": next((s for s in reversed(samples) if s["phase"] == "after"), None)}
    growth: dict = {}
    if points["start"] and points["end"]:
        a, b = points["start"]["rss"], points["end"]["rss"]
        growth = {k: round(b[k] - a[k], 1) for k in b if k in a}
        if points["middle"]:  # warm-up is over by then: what still grows is what a longer run would see
            m = points["middle"]["rss"]
            growth["second_half"] = {k: round(b[k] - m[k], 1) for k in b if k in m}
        ga, gb = points["start"].get("gpu"), points["end"].get("gpu")
        if ga and gb:
            growth["gpu_device_mb"] = (round(gb["device_used_mb"] - ga["device_used_mb"], 1)
                                       if gb.get("device_used_mb") is not None and ga.get("device_used_mb") is not None
                                       else None)
            growth["gpu_processes_mb"] = round(gb["processes_mb"] - ga["processes_mb"], 1)
    return {"points": points, "growth_mb": growth, "warm_s": warm_s}


def summarize(records: list[list], t0: float, t1: float, window_s: float, num_cases: int) -> dict:
    I = _I
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        st = r[I["status"]]
        by_kind[r[I["kind"]]]["n"] += 1
        by_kind[r[I["kind"]]]["ok" if st == "ok" else "cut" if st == "cut" else "failed"] += 1
    failed = [r for r in records if r[I["status"]] not in ("ok", "cut")]
    hostile = [r for r in records if r[I["kind"]].startswith("hostile-")]
    cut_clients = [r for r in records if r[I["kind"]].startswith(("disconnect-", "ws-disconnect-"))]
    return {
        "requests": {"all": len(records), "ok": sum(r[I["status"]] == "ok" for r in records),
                     "cut_by_stop": sum(r[I["status"]] == "cut" for r in records), "failed": len(failed),
                     "per_s": _r(len(records) / (t1 - t0), 2) if t1 > t0 else None},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "failures": dict(Counter(r[I["status"]] for r in failed).most_common(20)),
        "failure_examples": [dict(zip(RECORD, r)) for r in failed[:10]],
        "server_errors": sum(bool(r[I["server_error"]]) for r in records),
        "client_disconnects": {"all": len(cut_clients),
                               **dict(Counter(r[I["kind"]] for r in cut_clients).most_common()),
                               "before_audio": sum(r[I["t_first"]] is None for r in cut_clients)},
        "hostile": {"n": len(hostile), "as_expected": sum(r[I["status"]] == "ok" for r in hostile),
                    "cut_by_stop": sum(r[I["status"]] == "cut" for r in hostile),
                    "cases_sent": len({r[I["detail"]] for r in hostile}), "cases": num_cases},
        "ttfa_ms": {"http": _ttfa(_timed(records, False)), "ws": _ttfa(_timed(records, True))},
        "ttfa_windows": ttfa_windows(records, t0, t1, window_s),
        "audio_s": round(sum(r[I["audio_s"]] for r in records), 1),
    }


def _f(x, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(s: dict) -> str:
    m, req, host, dis = s["meta"], s["requests"], s["hostile"], s["client_disconnects"]
    slots, voices, crash = s["slots_after"], s["voices"], s["crashes"]
    kinds = ", ".join(f"{k} {v['n']}" for k, v in s["by_kind"].items())
    failures = "; ".join(f"{k}: {v}" for k, v in s["failures"].items()) or "0"
    exited = ", ".join(f"{c['process']} (pid {c['pid']})" for c in crash["exited"]) or "none"
    procs = ", ".join(sorted(set(m["server_processes"].values()))) or "not visible (--url without --server-pid)"
    dis_kinds = ", ".join(f"{k.replace('disconnect-', '')} {v}" for k, v in dis.items()
                          if k not in ("all", "before_audio"))
    lines = [
        f"## Soak: {m['users']} users for {m['duration_s']:.0f} s ({m['stopped_by']})",
        "",
        f"`{m['server']}`; commit {m['commit']}; {m['client_procs']} client processes on {m['cores']} cores; "
        f"users: {m['roles']}; client CPU max {_f(m.get('client_cpu_max'), '{:.2f}')} of a core, loop lag max "
        f"{_f(m.get('client_lag_max_ms'))} ms",
        "",
        "| | |",
        "|---|---|",
        f"| requests | {req['all']} ({_f(req['per_s'], '{:.1f}')}/s): {req['ok']} ok, {req['failed']} failed, "
        f"{req['cut_by_stop']} cut by the stop |",
        f"| by kind | {kinds} |",
        f"| client disconnects | {dis['all']} ({dis_kinds}; {dis['before_audio']} before any audio) |",
        f"| hostile | {host['as_expected']} of {host['n']} answered as expected ({host['cut_by_stop']} cut by the "
        f"stop; {host['cases_sent']} of {host['cases']} cases sent) |",
        f"| responses >= 500 | {s['server_errors']} seen by clients; server's request_errors_total 5xx: "
        f"{_f(s['server_5xx'])} |",
        f"| failures | {failures} |",
        f"| crashes | {len(crash['exited'])} exited: {exited}; {len(crash['appeared'])} started during the run "
        f"(server processes: {procs}) |",
        f"| slots in use after | {_f(slots['running'])} running, {_f(slots['waiting'])} waiting "
        f"({_f(slots['settle_s'], '{:.1f}')} s after the stop) |",
        f"| voices | {voices['created']} created and {voices['deleted']} deleted by the voice users; after the load "
        f"{voices['live_checked']} alive ({voices['stored']} made at the start) all listed and usable, "
        f"{voices['deleted_checked']} deleted all 404; problems: {len(voices['problems'])} |",
        f"| TTFA (client) | HTTP p50 {_f(s['ttfa_ms']['http']['p50'])} / p99 {_f(s['ttfa_ms']['http']['p99'])} ms; "
        f"WebSocket p50 {_f(s['ttfa_ms']['ws']['p50'])} / p99 {_f(s['ttfa_ms']['ws']['p99'])} ms; server p50 "
        f"{_f(s['server_ttfa_ms']['p50'])} / p99 {_f(s['server_ttfa_ms']['p99'])} ms |",
        "",
    ]
    pts, growth = s["memory"]["points"], s["memory"]["growth_mb"]
    names = [k for k in (pts.get("end") or pts.get("start") or {}).get("rss", {})]
    if names:
        cols = [p for p in ("idle", "start", "middle", "end", "after")]
        when = " | ".join(f"{c}" + (f" ({pts[c]['t']:.0f} s)" if pts.get(c) else "") for c in cols)
        lines += [f"Resident memory (MB; start = the first sample {s['memory']['warm_s']:.0f} s into the load, after "
                  "the ramp and a warm-up):", "",
                  f"| process | {when} | growth end - start | end - middle |", "|---" * (len(cols) + 3) + "|"]
        for n in names:
            vals = " | ".join(_f((pts[c] or {}).get("rss", {}).get(n), "{:.0f}") if pts.get(c) else "-" for c in cols)
            late = growth.get("second_half", {}).get(n)
            lines.append(f"| {n} | {vals} | {_f(growth.get(n), '{:+.0f}')} | {_f(late, '{:+.0f}')} |")
        gpu = [(pts[c] or {}).get("gpu") if pts.get(c) else None for c in cols]
        if any(gpu):
            vals = " | ".join(_f(g.get("device_used_mb") if g else None, "{:.0f}") for g in gpu)
            lines.append(f"| GPU 0 used | {vals} | {_f(growth.get('gpu_device_mb'), '{:+.0f}')} | |")
            vals = " | ".join(_f(g.get("processes_mb") if g else None, "{:.0f}") for g in gpu)
            lines.append(f"| GPU, server pids | {vals} | {_f(growth.get('gpu_processes_mb'), '{:+.0f}')} | |")
        lines.append("")
    lines += ["TTFA over time (client-side, ms, by when the request was sent):", "",
              "| window (s) | HTTP n | p50 | p99 | WebSocket n | p50 | p99 |", "|---|---|---|---|---|---|---|"]
    for w in s["ttfa_windows"]:
        h, ws = w["http"], w["ws"]
        lines.append(f"| {w['from_s']:.0f}-{w['to_s']:.0f} | {h['n']} | {_f(h['p50'])} | {_f(h['p99'])} | "
                     f"{ws['n']} | {_f(ws['p50'])} | {_f(ws['p99'])} |")
    if s["failure_examples"]:
        lines += ["", "First failures:", ""] + [f"- {e['kind']} (user {e['user']}): {e['status']} {e['detail']}"
                                               for e in s["failure_examples"]]
    if voices["problems"]:
        lines += ["", "Voice problems:", ""] + [f"- {p}" for p in voices["problems"][:10]]
    return "\n".join(lines) + "\n"
