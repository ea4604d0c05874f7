"""The soak (`python bench/soak.py`): hours-shaped load with everything a careless or hostile client does
(soak_users.py, in --client-procs processes), bounded by --duration and --max-requests, against a `csmserve
serve` it starts (or --url). Through the run: every server process's pid (crashes), RSS and GPU memory
(nvidia-smi); /metrics before and after. After the stop: the running/waiting gauges back to 0, every voice
acknowledged created and not deleted listed and usable, every deleted one 404. Reported (markdown on stdout,
JSON with every sample in --out): requests by kind, client disconnects, hostile answers, responses >= 500,
crashes, slots in use after, voices, memory, TTFA p50 / p99 per 30 s window.

TTFA: request sent -> first audio (HTTP speech read to its end, `voice-use` included), flush sent -> first
binary audio (WebSocket turns). Memory: `start` is the first sample after the ramp and a warm-up (allocators
and caches filling: the engine's RSS climbs for its first ~30 s on the CPU), `middle` the one nearest the
midpoint of start..end, `end` the last before the stop, `after` once the slots are free again; growth = end -
start (and end - middle).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from csmserve.apps.bench.serve import report, server as srv
from csmserve.apps.bench.serve.bench import SENTENCES, Clients, add_server_arguments, commit, out_base, session, settle
from csmserve.apps.bench.serve.hostile import CASES, GOOD
from csmserve.apps.bench.serve.report import I, f_, r_, ttfa_ms
from csmserve.apps.bench.serve.users import FORMATS, SPEECH_PATH
from csmserve.apps.common import bearer

# short texts beside the 10 s sentences: several sentences make a long-form request (one slot, segments)
TEXTS = SENTENCES + ("Hello there. How are you today? I hope the weather is kind to you.",
                     "Yes.", "One, two, three. Four, five, six.")
STORED_VOICES = 4  # made at the start, used by every user
WINDOW_S = 30.0  # TTFA per window of this many seconds
SPEECH_KINDS = ("speech-", "voice-use")


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_server_arguments(ap, max_slots="users x 1.1 + 16")
    s = ap.add_argument_group("the server's processes")
    s.add_argument("--api-workers", type=int, default=None, help="the server's --api-workers (default: its own)")
    s.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's pid on this machine, to watch its processes and memory "
                        "(default: not watched)")
    g = ap.add_argument_group("the load")
    g.add_argument("--users", type=int, default=64, help="concurrent users (default: 64; 1000 on the H200)")
    g.add_argument("--duration", type=float, default=120.0, help="seconds of load (default: 120)")
    g.add_argument("--max-requests", type=int, default=0, help="stop once this many requests ended (default: 0, "
                                                               "no bound)")
    g.add_argument("--ws-users", type=float, default=0.2, help="share of users on WebSocket conversations "
                                                               "(default: 0.2)")
    g.add_argument("--voice-users", type=int, default=None, help="users creating and deleting voices "
                                                                 "(default: users / 50, at least 1)")
    g.add_argument("--disconnect", type=float, default=0.10, help="share of requests cut mid-stream (default: 0.10)")
    g.add_argument("--hostile", type=float, default=0.05, help="share of requests that are hostile (default: 0.05)")
    g.add_argument("--audio-ms", default="1000,4000", help="max_audio_length_ms drawn from LO,HI; the disconnects "
                                                            "ask for HI (default: 1000,4000)")
    g.add_argument("--turns", default="2,5", help="turns per WebSocket conversation, LO,HI (default: 2,5)")
    return ap


def _pair(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{name} must be LO,HI, got {text!r}") from None
    if not 0 < lo <= hi:
        raise ValueError(f"--{name} must be 0 < LO <= HI, got {text!r}")
    return lo, hi


def roles(args: argparse.Namespace) -> list[str]:
    """user index -> http | ws | voice, shuffled (seeded) so that the ramp starts every kind early."""
    n_voice = args.voice_users if args.voice_users is not None else max(1, args.users // 50)
    n_ws = round(args.users * args.ws_users)
    if n_voice + n_ws > args.users:
        raise ValueError(f"--users {args.users} is fewer than the voice users ({n_voice}) + WebSocket users ({n_ws})")
    out = ["voice"] * n_voice + ["ws"] * n_ws + ["http"] * (args.users - n_voice - n_ws)
    random.Random(0).shuffle(out)
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, clients: Clients, server: srv.ServerProcess | None,
                 tree: srv.ServerTree | None) -> None:
        self.args, self.url, self.clients, self.server, self.tree = args, url, clients, server, tree
        self.headers = bearer(args.api_key)
        self.records: list[list] = []
        self.samples: list[dict] = []
        self.results: list[dict] = []
        self.t0 = 0.0

    def sample(self, phase: str) -> None:
        if self.tree is not None:
            self.samples.append({"t": round(time.monotonic() - self.t0, 1), "phase": phase,
                                 "rss": self.tree.memory(), "gpu": srv.gpu_memory(list(self.tree.procs))})

    def pump(self, timeout: float) -> None:
        """Take the client processes' messages for up to `timeout` s."""
        for _, msg in self.clients.messages(time.monotonic() + timeout, self.server):
            if msg.get("event") == "records":
                self.records += msg["records"]
            elif msg.get("event") == "result":
                self.records += msg.pop("records")
                self.results.append(msg)

    def load(self, stored: list[str], run_id: str) -> tuple[float, float, str]:
        a, who, n = self.args, roles(self.args), len(self.clients.procs)
        ramp = min(10.0, a.duration / 10)
        every = min(15.0, max(1.0, a.duration / 40))  # seconds between memory samples
        self.t0 = t_start = time.monotonic() + 1.0
        self.sample("idle")
        for i in range(n):
            self.clients.send(i, {"cmd": "soak", "url": self.url, "api_key": a.api_key, "t_start": t_start,
                                  "ramp": ramp, "num_users": a.users, "users": [[u, who[u]] for u in range(i, a.users, n)],
                                  "texts": list(TEXTS), "voices": stored, "formats": list(FORMATS),
                                  "audio_ms": _pair(a.audio_ms, "audio-ms"), "turns": _pair(a.turns, "turns"),
                                  "disconnect": a.disconnect, "hostile": a.hostile, "seed": 0, "run_id": run_id})
        t_end, next_sample, next_note, stopped_by = t_start + a.duration, t_start + ramp, t_start + 60.0, "duration"
        while time.monotonic() < t_end:
            self.pump(0.5)
            if a.max_requests and len(self.records) >= a.max_requests:
                stopped_by = f"max-requests {a.max_requests}"
                break
            if time.monotonic() >= next_sample:
                self.sample("load")
                next_sample += every
            if time.monotonic() >= next_note:
                self.progress()
                next_note += 60.0
        if not self.samples or time.monotonic() - self.t0 - self.samples[-1]["t"] > 0.5:
            self.sample("load")
        load_end = time.monotonic()
        for i in range(n):
            self.clients.send(i, {"cmd": "stop"})
        deadline = time.monotonic() + 120
        while len(self.results) < n and time.monotonic() < deadline:
            self.pump(0.5)
        if len(self.results) < n:
            raise RuntimeError(f"only {len(self.results)} of {n} client processes reported")
        return ramp, load_end - t_start, stopped_by

    def progress(self) -> None:
        """A line a minute on stderr (what a run cut short still leaves)."""
        failed = sum(r[I["status"]] not in ("ok", "cut") for r in self.records)
        server = sum(bool(r[I["server_error"]]) for r in self.records)
        rss = self.samples[-1]["rss"] if self.samples else {}
        gone = len(self.tree.exited()) if self.tree else "?"
        print(f"soak: {time.monotonic() - self.t0:.0f} s: {len(self.records)} requests, {failed} failed, {server} "
              f">= 500, {gone} server processes exited; RSS MB {rss}", file=sys.stderr, flush=True)

    def check_voices(self, stored: list[str]) -> dict:
        import httpx

        live: dict[str, int] = {vid: 0 for vid in stored}
        deleted, uncertain, problems = [], [], []
        for res in self.results:
            live.update(res["voices"]["live"])
            deleted += res["voices"]["deleted"]
            uncertain += res["voices"]["uncertain"]
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as c:
            listed = {v["id"] for v in c.get("/v1/audio/voices").json()["data"]}
            for vid in live:
                if vid not in listed:
                    problems.append(f"{vid}: created and not deleted, not listed")
                    continue
                r = c.post(SPEECH_PATH, json={**GOOD, "voice": vid, "max_audio_length_ms": 160})
                if r.status_code != 200 or not r.content:
                    problems.append(f"{vid}: created and not deleted, speech answers HTTP {r.status_code}")
            for vid in deleted:
                if vid in listed:
                    problems.append(f"{vid}: deleted, still listed")
                if (g := c.get(f"/v1/audio/voices/{vid}")).status_code != 404:
                    problems.append(f"{vid}: deleted, GET answers HTTP {g.status_code}")
            if deleted and (r := c.post(SPEECH_PATH, json={**GOOD, "voice": deleted[-1]})).status_code != 404:
                problems.append(f"{deleted[-1]}: deleted, speech answers HTTP {r.status_code}")
        return {"stored": len(stored), "created": len(live) - len(stored) + len(deleted), "deleted": len(deleted),
                "live_checked": len(live), "deleted_checked": len(deleted), "uncertain": len(uncertain),
                "problems": problems, "live_ids": sorted(live)}


def run(args: argparse.Namespace) -> dict:
    """The soak -> its summary (also written to --out, printed as markdown)."""
    if args.users < 1 or args.duration <= 0:
        raise ValueError("--users must be >= 1 and --duration > 0")
    _pair(args.audio_ms, "audio-ms"), _pair(args.turns, "turns"), roles(args)
    base = out_base(args.out)
    run_id = f"soak{int(time.time()) % 10**6}"
    serve = srv.serve_args(args, max_slots=args.max_slots or int(args.users * 1.1) + 16)
    with session(args, lambda tmp: serve, base, "csmserve-soak-") as (url, server, clients):
        root = server.proc.pid if server is not None else args.server_pid
        tree = srv.ServerTree(root) if root is not None and srv.alive(root) else None
        if tree is not None:
            tree.start()
        soak, stored = Soak(args, url, clients, server, tree), []
        try:
            stored = srv.create_voices(url, STORED_VOICES, soak.headers, prefix=f"{run_id}-stored")
            before = report.Sampler(url).scrape()
            print(f"soak: {args.users} users for {args.duration:g} s ({len(clients.procs)} client processes)",
                  file=sys.stderr, flush=True)
            ramp, load_s, stopped_by = soak.load(stored, run_id)
            t = time.monotonic()
            running, waiting = settle(url, 30.0, patient=True) or (None, None)
            slots = {"running": running, "waiting": waiting, "settle_s": round(time.monotonic() - t, 2)}
            voices = soak.check_voices(stored)
            soak.sample("after")
            after = report.Sampler(url).scrape()
            if server is not None and not server.alive():
                raise RuntimeError(f"the server exited during the soak:\n{server.log_tail()}")
            summary = summarize(soak.records, soak.t0, soak.t0 + load_s)
            summary.update({
                "meta": {"server": url if args.url else "csmserve serve " + " ".join(serve), "commit": commit(),
                         "cores": os.cpu_count(), "client_procs": len(clients.procs), "users": args.users,
                         "roles": {r: roles(args).count(r) for r in ("http", "ws", "voice")},
                         "duration_s": round(load_s, 1), "ramp_s": ramp, "stopped_by": stopped_by,
                         "argv": sys.argv[1:],
                         "server_processes": {str(p): n for p, n in tree.procs.items()} if tree else {},
                         "client_cpu_max": max((r["cpu_s"] / r["wall_s"] for r in soak.results if r["wall_s"]),
                                               default=None),
                         "client_lag_max_ms": max((r["loop_lag_max_ms"] for r in soak.results), default=None)},
                "slots_after": slots, "voices": voices,
                "crashes": {"exited": tree.exited() if tree else [], "appeared": tree.appeared() if tree else []},
                "memory": memory_points(soak.samples, ramp + min(60.0, args.duration / 4), load_s)
                | {"samples": soak.samples},
                "server_5xx": None, "server_ttfa_ms": {"p50": None, "p99": None},
                "clients": [{k: v for k, v in r.items() if k != "voices"} for r in soak.results],
            })
            if (seen := report.server_summary(before, after, [], 0.0, 0.0)) is not None:
                summary["server_5xx"] = sum(v for k, v in seen["errors"].items() if k.startswith("5"))
                summary["server_errors_by_status"] = seen["errors"]
                summary["server_ttfa_ms"] = {"p50": seen["ttfa_p50_ms"], "p99": seen["ttfa_p99_ms"]}
            md = markdown(summary)
            print(md, flush=True)
            if base:
                base.parent.mkdir(parents=True, exist_ok=True)
                Path(f"{base}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
                Path(f"{base}.md").write_text(md)
            return summary
        finally:
            if args.url:  # leave a running server as it was
                srv.delete_voices(url, stored + [v for r in soak.results for v in r["voices"]["live"]], soak.headers)


# ---------------------------------------------------------------- the report
def _timed(records: list[list], ws: bool) -> list[list]:
    return [r for r in records if r[I["status"]] == "ok" and r[I["t_first"]] is not None
            and (r[I["kind"]] == "ws-turn" if ws else r[I["kind"]].startswith(SPEECH_KINDS))]


def ttfa_windows(records: list[list], t0: float, t1: float) -> list[dict]:
    http, ws = _timed(records, False), _timed(records, True)
    out, start = [], t0
    while start < t1 - 1e-9:
        end = start + WINDOW_S
        end = t1 if end > t1 or t1 - end < WINDOW_S / 3 else end  # a short tail joins the last window
        sent = [[r for r in rs if start <= r[I["t_send"]] < end] for rs in (http, ws)]
        out.append({"from_s": round(start - t0, 1), "to_s": round(end - t0, 1),
                    "http": ttfa_ms(sent[0], (50, 99)), "ws": ttfa_ms(sent[1], (50, 99))})
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
        a, b, m = points["start"]["rss"], points["end"]["rss"], points["middle"]["rss"]
        growth = {k: round(b[k] - a[k], 1) for k in b if k in a}
        # warm-up is over by the middle: what still grows is what a longer run would see
        growth["second_half"] = {k: round(b[k] - m[k], 1) for k in b if k in m}
        ga, gb = points["start"].get("gpu"), points["end"].get("gpu")
        if ga and gb:
            growth["gpu_device_mb"] = None if None in (gb["device_used_mb"], ga["device_used_mb"]) \
                else round(gb["device_used_mb"] - ga["device_used_mb"], 1)
            growth["gpu_processes_mb"] = round(gb["processes_mb"] - ga["processes_mb"], 1)
    return {"points": points, "growth_mb": growth, "warm_s": warm_s}


def summarize(records: list[list], t0: float, t1: float) -> dict:
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
                     "per_s": r_(len(records) / (t1 - t0), 2) if t1 > t0 else None},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "failures": dict(Counter(r[I["status"]] for r in failed).most_common(20)),
        "failure_examples": [dict(zip(I, r)) for r in failed[:10]],
        "server_errors": sum(bool(r[I["server_error"]]) for r in records),
        "client_disconnects": {"all": len(cut_clients),
                               **dict(Counter(r[I["kind"]] for r in cut_clients).most_common()),
                               "before_audio": sum(r[I["t_first"]] is None for r in cut_clients)},
        "hostile": {"n": len(hostile), "as_expected": sum(r[I["status"]] == "ok" for r in hostile),
                    "cut_by_stop": sum(r[I["status"]] == "cut" for r in hostile),
                    "cases_sent": len({r[I["detail"]] for r in hostile}), "cases": len(CASES)},
        "ttfa_ms": {"http": ttfa_ms(_timed(records, False), (50, 99)), "ws": ttfa_ms(_timed(records, True), (50, 99))},
        "ttfa_windows": ttfa_windows(records, t0, t1),
        "audio_s": round(sum(r[I["audio_s"]] for r in records), 1),
    }


def markdown(s: dict) -> str:
    m, req, host, dis = s["meta"], s["requests"], s["hostile"], s["client_disconnects"]
    slots, voices, crash, ttfa = s["slots_after"], s["voices"], s["crashes"], s["ttfa_ms"]
    kinds = ", ".join(f"{k} {v['n']}" for k, v in s["by_kind"].items())
    exited = ", ".join(f"{c['process']} (pid {c['pid']})" for c in crash["exited"]) or "none"
    procs = ", ".join(sorted(set(m["server_processes"].values()))) or "not visible (--url without --server-pid)"
    dis_kinds = ", ".join(f"{k.replace('disconnect-', '')} {v}" for k, v in dis.items()
                          if k not in ("all", "before_audio"))
    lines = [
        f"## Soak: {m['users']} users for {m['duration_s']:.0f} s ({m['stopped_by']})", "",
        f"`{m['server']}`; commit {m['commit']}; {m['client_procs']} client processes on {m['cores']} cores; "
        f"users: {m['roles']}; client CPU max {f_(m['client_cpu_max'], '{:.2f}')} of a core, loop lag max "
        f"{f_(m['client_lag_max_ms'])} ms", "", "| | |", "|---|---|",
        f"| requests | {req['all']} ({f_(req['per_s'], '{:.1f}')}/s): {req['ok']} ok, {req['failed']} failed, "
        f"{req['cut_by_stop']} cut by the stop |",
        f"| by kind | {kinds} |",
        f"| client disconnects | {dis['all']} ({dis_kinds}; {dis['before_audio']} before any audio) |",
        f"| hostile | {host['as_expected']} of {host['n']} answered as expected ({host['cut_by_stop']} cut by the "
        f"stop; {host['cases_sent']} of {host['cases']} cases sent) |",
        f"| responses >= 500 | {s['server_errors']} seen by clients; server's request_errors_total 5xx: "
        f"{f_(s['server_5xx'])} |",
        f"| failures | {'; '.join(f'{k}: {v}' for k, v in s['failures'].items()) or '0'} |",
        f"| crashes | {len(crash['exited'])} exited: {exited}; {len(crash['appeared'])} started during the run "
        f"(server processes: {procs}) |",
        f"| slots in use after | {f_(slots['running'])} running, {f_(slots['waiting'])} waiting "
        f"({f_(slots['settle_s'], '{:.1f}')} s after the stop) |",
        f"| voices | {voices['created']} created and {voices['deleted']} deleted by the voice users; after the load "
        f"{voices['live_checked']} alive ({voices['stored']} made at the start) all listed and usable, "
        f"{voices['deleted_checked']} deleted all 404; problems: {len(voices['problems'])} |",
        f"| TTFA (client) | HTTP p50 {f_(ttfa['http']['p50'])} / p99 {f_(ttfa['http']['p99'])} ms; WebSocket p50 "
        f"{f_(ttfa['ws']['p50'])} / p99 {f_(ttfa['ws']['p99'])} ms; server p50 {f_(s['server_ttfa_ms']['p50'])} / "
        f"p99 {f_(s['server_ttfa_ms']['p99'])} ms |", ""]
    pts, growth, cols = s["memory"]["points"], s["memory"]["growth_mb"], ("idle", "start", "middle", "end", "after")
    if names := list((pts["end"] or pts["start"] or {}).get("rss", {})):
        when = " | ".join(c + (f" ({pts[c]['t']:.0f} s)" if pts[c] else "") for c in cols)
        lines += [f"Resident memory (MB; start = the first sample {s['memory']['warm_s']:.0f} s into the load, after "
                  "the ramp and a warm-up):", "",
                  f"| process | {when} | growth end - start | end - middle |", "|---" * (len(cols) + 3) + "|"]
        for n in names:
            vals = " | ".join(f_((pts[c] or {}).get("rss", {}).get(n)) for c in cols)
            lines.append(f"| {n} | {vals} | {f_(growth.get(n), '{:+.0f}')} | "
                         f"{f_(growth.get('second_half', {}).get(n), '{:+.0f}')} |")
        if any(gpu := [(pts[c] or {}).get("gpu") for c in cols]):
            for label, key, grown in (("GPU 0 used", "device_used_mb", "gpu_device_mb"),
                                      ("GPU, server pids", "processes_mb", "gpu_processes_mb")):
                vals = " | ".join(f_(g.get(key) if g else None) for g in gpu)
                lines.append(f"| {label} | {vals} | {f_(growth.get(grown), '{:+.0f}')} | |")
        lines.append("")
    lines += ["TTFA over time (client-side, ms, by when the request was sent):", "",
              "| window (s) | HTTP n | p50 | p99 | WebSocket n | p50 | p99 |", "|---|---|---|---|---|---|---|"]
    for w in s["ttfa_windows"]:
        h, ws = w["http"], w["ws"]
        lines.append(f"| {w['from_s']:.0f}-{w['to_s']:.0f} | {h['n']} | {f_(h['p50'])} | {f_(h['p99'])} | "
                     f"{ws['n']} | {f_(ws['p50'])} | {f_(ws['p99'])} |")
    if s["failure_examples"]:
        lines += ["", "First failures:", ""] + [f"- {e['kind']} (user {e['user']}): {e['status']} {e['detail']}"
                                               for e in s["failure_examples"]]
    if voices["problems"]:
        lines += ["", "Voice problems:", ""] + [f"- {p}" for p in voices["problems"][:10]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = add_arguments(argparse.ArgumentParser(
        prog="soak", description="The soak: many users for minutes, mixed with disconnects, hostile requests, "
                                 "voice churn and conversations; crashes, 5xx, slots, memory, TTFA over time. "
                                 "csmserve/apps/bench/serve/soak.py."))
    args = ap.parse_args(argv)
    try:
        s = run(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"soak: error: {e}", file=sys.stderr)
        return 2
    bad = (s["server_errors"] or s["server_5xx"] or s["crashes"]["exited"] or s["slots_after"]["running"]
           or s["slots_after"]["waiting"] or s["voices"]["problems"])
    return 1 if bad else 0
