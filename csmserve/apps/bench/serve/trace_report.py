"""`csmserve serve --trace-requests DIR`'s files (engine/trace.py) joined into one timeline per request,
and where the time to first audio went: every phase's median and mean for all requests and for those
above the p90 and p99 TTFA, the slow ones' GC pauses and steps waited, the engine's step times.

    python bench/trace_report.py DIR [--since T0 --until T1]   # T: perf_counter seconds (requests received)

TTFA here is the worker's: HTTP request received -> its first audio bytes handed to the response.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from csmserve.engine.outputs import CLIENT_SHIFT

# the timeline's stamps in order; a phase is the time between two of them
STAMPS = ("received", "build0", "build1", "built", "sent", "drained", "admitted", "launched", "collected",
          "emitted", "recv", "delivered", "chunk", "written")
PHASES = (  # (label, from, to, indent): indented rows split the row above them
    ("received -> built", "received", "built", 0),
    ("received -> build start (body, voice)", "received", "build0", 1),
    ("build in the thread (queue + run)", "build0", "build1", 1),
    ("thread -> event loop (hop back)", "build1", "built", 1),
    ("built -> sent", "built", "sent", 0),
    ("sent -> drained (engine)", "sent", "drained", 0),
    ("drained -> admitted", "drained", "admitted", 0),
    ("admitted -> launched (first frame step)", "admitted", "launched", 0),
    ("launched -> collected", "launched", "collected", 0),
    ("collected -> emitted", "collected", "emitted", 0),
    ("emitted -> worker received", "emitted", "recv", 0),
    ("worker received -> chunk written", "recv", "written", 0),
    ("reader thread -> Router on the loop", "recv", "delivered", 1),
    ("Router -> stream consumer", "delivered", "chunk", 1),
    ("consumer -> bytes to the response", "chunk", "written", 1),
    ("TTFA (received -> written)", "received", "written", 0),
)
GC_SLOW_S = 0.010


@dataclass
class Proc:
    role: str
    pid: int
    tables: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)


def load(directory: str | Path) -> list[Proc]:
    procs = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        proc, rows = None, {}
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by a killed process
                continue
            k = rec.get("k")
            if k == "meta":
                proc = Proc(rec["role"], rec["pid"])
            elif k == "req":
                (proc.requests if proc is not None else []).append(rec)
            elif "cols" in rec:
                cols, got = rec["cols"], rows.setdefault(k, ([], []))
                got[0][:] = cols
                got[1].extend(rec["rows"])
        if proc is None:
            continue
        for k, (cols, data) in rows.items():
            a = np.array(data, dtype=np.float64).reshape(-1, len(cols)) if data else np.zeros((0, len(cols)))
            proc.tables[k] = {c: a[:, i] for i, c in enumerate(cols)}
        procs.append(proc)
    return procs


def _by_step(table: dict[str, np.ndarray] | None, col: str) -> dict[int, float]:
    if not table:
        return {}
    return dict(zip(table["step"].astype(np.int64).tolist(), table[col].tolist()))


def timelines(procs: list[Proc]) -> list[dict]:
    """One dict per request the workers saw: every stamp of STAMPS that exists, plus `worker` (its
    process), `dstep` / `fstep` (the step its drain fed / that ran its first frame)."""
    engine_reqs = {r["id"]: r for p in procs for r in p.requests if "drained" in r}
    engine = next((p.tables for p in procs if p.role == "engine"), {})
    launched = _by_step(engine.get("step"), "t_launched")
    collected = _by_step(engine.get("collect"), "t_done")
    em = engine.get("emit")
    emitted = {} if not em else dict(zip(zip(em["step"].astype(np.int64).tolist(),
                                             em["client"].astype(np.int64).tolist()), em["t"].tolist()))
    out = []
    for p in procs:
        recv = _by_step(p.tables.get("recv"), "t_recv")
        delivered = _by_step(p.tables.get("recv"), "t_deliver")
        for r in p.requests:
            if "received" not in r:
                continue
            t = {s: r[s] for s in STAMPS if s in r}
            t["id"], t["worker"] = r["id"], p.pid
            e = engine_reqs.get(r["id"])
            if e is not None:
                t.update({s: e[s] for s in ("drained", "admitted") if s in e})
                t["dstep"] = e.get("dstep")
                f = e.get("fstep")
                if f is not None:
                    t["fstep"] = f
                    for name, m in (("launched", launched), ("collected", collected), ("recv", recv),
                                    ("delivered", delivered)):
                        if f in m:
                            t[name] = m[f]
                    key = (f, e["handle"] >> CLIENT_SHIFT)
                    if key in emitted:
                        t["emitted"] = emitted[key]
            out.append(t)
    return out


def _phase(ts: list[dict], a: str, b: str) -> np.ndarray:
    return np.array([t[b] - t[a] for t in ts if a in t and b in t])


def _ms(x: np.ndarray, f) -> str:
    return f"{f(x) * 1e3:8.1f}" if len(x) else "       -"


def _gc_pauses(procs: list[Proc]) -> dict[int, np.ndarray]:
    """pid -> the pauses >= GC_SLOW_S as [n, 2] (t0, t1)."""
    gcs = {p.pid: p.tables["gc"] for p in procs if p.tables.get("gc")}
    return {pid: np.stack([g["t0"], g["t1"]], 1)[g["t1"] - g["t0"] >= GC_SLOW_S] for pid, g in gcs.items()}


def _overlaps(t: dict, pauses: np.ndarray) -> bool:
    return bool(len(pauses)) and bool(((pauses[:, 0] < t["written"]) & (pauses[:, 1] > t["received"])).any())


def _pct(x: np.ndarray, qs=(50, 90, 99)) -> str:
    if not len(x):
        return "-"
    return " / ".join(f"{np.percentile(x, q) * 1e3:.1f}" for q in qs) + f" / {x.max() * 1e3:.1f}"


def report(directory: str | Path, since: float | None = None, until: float | None = None) -> list[str]:
    procs = load(directory)
    ts = [t for t in timelines(procs) if "written" in t and (since is None or t["received"] >= since)
          and (until is None or t["received"] < until)]
    lines = [f"trace {directory}: {len(ts)} requests with a first chunk written, "
             f"{sum(p.role == 'worker' for p in procs)} worker file(s), "
             f"{sum(p.role == 'engine' for p in procs)} engine file(s)"]
    if not ts:
        return lines
    ttfa = np.array([t["written"] - t["received"] for t in ts])
    p90, p99 = np.percentile(ttfa, 90), np.percentile(ttfa, 99)
    groups = [("all", ts), (f">p90 ({p90 * 1e3:.0f} ms)", [t for t, x in zip(ts, ttfa) if x > p90]),
              (f">p99 ({p99 * 1e3:.0f} ms)", [t for t, x in zip(ts, ttfa) if x > p99])]
    lines.append("")
    lines.append(f"{'phase (ms)':42s}" + "".join(f"{name + ' n=' + str(len(g)):>20s}" for name, g in groups))
    lines.append(f"{'':42s}" + "".join(f"{'median':>10s}{'mean':>10s}" for _ in groups))
    for label, a, b, indent in PHASES:
        row = f"{'  ' * indent + label:42s}"
        for _, g in groups:
            x = _phase(g, a, b)
            row += f"  {_ms(x, np.median)}  {_ms(x, np.mean)}"
        lines.append(row)
    # steps waited between the drain and the first frame step (0: the same step)
    lines.append("")
    for name, g in groups:
        w = np.array([t["fstep"] - t["dstep"] for t in g if t.get("fstep") is not None and t.get("dstep") is not None])
        if len(w):
            hist = ", ".join(f"{k}: {int((w == k).sum())}" for k in range(3)) + f", 3+: {int((w >= 3).sum())}"
            lines.append(f"steps from drain to first frame step, {name}: {hist} (more than one: {int((w > 1).sum())})")
    # GC pauses >= 10 ms overlapping a request's [received, written], by process
    pauses = _gc_pauses(procs)
    engine_pids = {p.pid for p in procs if p.role == "engine"}
    lines.append("")
    for name, g in groups[1:]:
        own = sum(_overlaps(t, pauses.get(t["worker"], np.zeros((0, 2)))) for t in g)
        eng = sum(any(_overlaps(t, pauses[pid]) for pid in engine_pids if pid in pauses) for t in g)
        other = sum(any(_overlaps(t, v) for pid, v in pauses.items() if pid != t["worker"] and pid not in engine_pids)
                    for t in g)
        lines.append(f"{name}: {len(g)} requests; overlapping a GC pause >= {GC_SLOW_S * 1e3:.0f} ms in their own "
                     f"worker {own}, the engine {eng}, another worker {other}")
    for p in procs:
        g = p.tables.get("gc")
        if not g or not len(g["t0"]):
            continue
        dt = g["t1"] - g["t0"]
        sel = np.ones(len(dt), bool) if since is None else (g["t0"] >= since) & (g["t0"] < (until or np.inf))
        dt, gen = dt[sel], g["gen"][sel]
        if len(dt):
            by_gen = ", ".join(f"gen{k} {int((gen == k).sum())} max {dt[gen == k].max() * 1e3:.1f} ms"
                               for k in range(3) if (gen == k).any())
            lines.append(f"GC {p.role} {p.pid}: {len(dt)} pauses ({by_gen}); >= 10 ms: {int((dt >= GC_SLOW_S).sum())}")
    lines += _steps(procs, groups, since, until)
    return lines


def _steps(procs: list[Proc], groups, since, until) -> list[str]:
    engine = next((p for p in procs if p.role == "engine"), None)
    if engine is None or "collect" not in engine.tables:
        return []
    c, s = engine.tables["collect"], engine.tables.get("step")
    lo, hi = since if since is not None else -np.inf, until if until is not None else np.inf
    m = (c["t_done"] >= lo) & (c["t_done"] < hi)
    period = np.diff(c["t_done"])[m[1:]]  # one step's results to the next's
    out = ["", "engine steps (ms, p50 / p90 / p99 / max):"]
    out.append(f"  results to results (step period)   {_pct(period)}  ({int(m.sum())} steps)")
    out.append(f"  results to EngineSteps sent        {_pct((c['t_emitted'] - c['t_done'])[m])}")
    if s is not None and len(s["step"]):
        ms = (s["t_launched"] >= lo) & (s["t_launched"] < hi)
        out.append(f"  pacer's sleep before the drain     {_pct((s['t_awake'] - s['t_iter'])[ms])}")
        out.append(f"  drain (inbox read)                 {_pct((s['t_drained'] - s['t_awake'])[ms])}")
        out.append(f"  schedule + admit + prefill + launch {_pct((s['t_launched'] - s['t_sched'])[ms])}")
        out.append(f"  reader waits (_await_readers)      {_pct(s['reader_wait'][ms])}")
        out.append(f"  rows per step p50 {np.median(s['rows'][ms]) if ms.any() else 0:.0f}, admissions per step "
                   f"max {s['admits'][ms].max() if ms.any() else 0:.0f}")
    # the period of the step that carried each slow request's first frame
    done = _by_step(c, "t_done")
    for name, g in groups:
        x = np.array([done[t["fstep"]] - done[t["fstep"] - 1] for t in g
                      if t.get("fstep") is not None and t["fstep"] in done and t["fstep"] - 1 in done])
        if len(x):
            out.append(f"  first frame step's period, {name}: median {np.median(x) * 1e3:.1f}, max {x.max() * 1e3:.1f}")
    for p in procs:
        f = p.tables.get("flush")
        if f and len(f["t0"]):
            dt = f["t1"] - f["t0"]
            out.append(f"trace's own writes, {p.role} {p.pid}: {len(dt)} flushes, max {dt.max() * 1e3:.1f} ms, "
                       f"{dt.sum() * 1e3:.0f} ms in all")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trace_report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="the --trace-requests directory")
    ap.add_argument("--since", type=float, default=None, help="only requests received at or after this perf_counter")
    ap.add_argument("--until", type=float, default=None, help="only requests received before this perf_counter")
    args = ap.parse_args(argv)
    if not Path(args.dir).is_dir():
        print(f"trace_report: {args.dir} is not a directory", file=sys.stderr)
        return 2
    print("\n".join(report(args.dir, args.since, args.until)))
    return 0
