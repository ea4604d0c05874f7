"""The soak (`python bench/soak.py`): hours-shaped load with everything a careless or hostile client does,
bounded by --duration and --max-requests, against a `csmserve serve` it starts (or --url).

    users      http (speech in several formats; --disconnect of them cut mid-stream by FIN / RST; --hostile
               of them hostile.py's cases), ws (conversations: a context_id each, several turns), voice
               (create / use / delete / check gone); soak_users.py, in --client-procs processes
    watches    every server process's pid (crashes) and RSS, GPU memory (nvidia-smi), sampled through
               the run; /metrics before and after
    after      the stop: the engine's running/waiting gauges back to 0; every voice acknowledged created
               and not deleted listed and usable, every deleted one 404
    reports    requests by kind, client disconnects, hostile answers, responses >= 500, crashes, slots in
               use after, voices, memory at start / middle / end (growth), TTFA p99 per --window; markdown
               on stdout, JSON with every sample in --out
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from csmserve.apps.bench.serve import metrics
from csmserve.apps.bench.serve.bench import (
    SENTENCES,
    Worker,
    _child_env,
    start_or_attach,
    _commit,
    _out_base,
    default_client_procs,
)
from csmserve.apps.bench.serve.hostile import CASES
from csmserve.apps.bench.serve.server import (
    ServerProcess,
    create_voices,
    delete_voices,
    raise_fd_limit,
)
from csmserve.apps.bench.serve.soak_report import markdown, memory_points, summarize
from csmserve.apps.bench.serve.soak_users import GOOD, RECORD, SPEECH_PATH
from csmserve.apps.bench.serve.tree import ServerTree, gpu_memory, own_pid_ok

# short texts beside the 10 s sentences: several sentences make a long-form request (one slot, segments)
TEXTS = SENTENCES + ("Hello there. How are you today? I hope the weather is kind to you.",
                     "Yes.", "One, two, three. Four, five, six.")
FORMATS = ("pcm", "mp3", "opus", "wav")


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    s = ap.add_argument_group("the server (started here unless --url)")
    s.add_argument("--model", default="dummy", help="the server's --model (default dummy: random full-size weights)")
    s.add_argument("--device", default=None, help="the server's --device")
    s.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="the server's --dtype")
    s.add_argument("--max-seq-len", type=int, default=512, help="the server's --max-seq-len (default 512)")
    s.add_argument("--max-slots", type=int, default=None, help="the server's --max-slots (default users * 1.1 + 16)")
    s.add_argument("--api-workers", type=int, default=None, help="the server's --api-workers (default: its own)")
    s.add_argument("--server-args", default="", help="more `csmserve serve` flags, one string")
    s.add_argument("--url", default=None, help="a running server: none is started")
    s.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's pid on this machine, to watch its processes and memory")
    s.add_argument("--ready-timeout", type=float, default=900.0, help="s to wait for /ready (default 900)")
    s.add_argument("--server-log", default=None, help="the server's output (default OUT.server.log or a temp file)")
    s.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"), help="Bearer key [env CSMSERVE_API_KEY]")
    g = ap.add_argument_group("the load")
    g.add_argument("--users", type=int, default=64, help="concurrent users (default 64; 1000 on the H200)")
    g.add_argument("--duration", type=float, default=120.0, help="s of load (default 120)")
    g.add_argument("--max-requests", type=int, default=0, help="stop once this many requests ended (0: no bound)")
    g.add_argument("--ramp", type=float, default=None, help="users start spread over this many s (default "
                                                           "min(10, duration / 10))")
    g.add_argument("--client-procs", type=int, default=None,
                   help=f"client processes (default cores / 2, here {default_client_procs()})")
    g.add_argument("--ws-users", type=float, default=0.2, help="share of users on WebSocket conversations (0.2)")
    g.add_argument("--voice-users", type=int, default=None, help="users creating and deleting voices "
                                                                 "(default users / 50, at least 1)")
    g.add_argument("--disconnect", type=float, default=0.10, help="share of requests cut mid-stream (0.10)")
    g.add_argument("--hostile", type=float, default=0.05, help="share of requests that are hostile (0.05)")
    g.add_argument("--formats", default=",".join(FORMATS), help=f"speech formats (default {','.join(FORMATS)})")
    g.add_argument("--audio-ms", default="1000,4000", help="max_audio_length_ms drawn from LO,HI (default "
                                                            "1000,4000; the disconnects ask for HI)")
    g.add_argument("--turns", default="2,5", help="turns per WebSocket conversation, LO,HI (default 2,5)")
    g.add_argument("--stored-voices", type=int, default=4, help="voices made at the start, used by every user (4)")
    g.add_argument("--keep-voices", type=int, default=2, help="voices each voice user keeps alive (2)")
    g.add_argument("--seed", type=int, default=0, help="the users' random choices (default 0)")
    o = ap.add_argument_group("measuring")
    o.add_argument("--window", type=float, default=30.0, help="TTFA per window of this many s (default 30)")
    o.add_argument("--warmup", type=float, default=None,
                   help="s after the ramp before memory's `start` point (default min(60, duration / 4))")
    o.add_argument("--sample-every", type=float, default=None,
                   help="s between memory samples (default duration / 40, 1..15)")
    o.add_argument("--settle", type=float, default=30.0, help="s to wait for the slots to free after the stop (30)")
    o.add_argument("--out", help="write OUT.json and OUT.md (a .json/.md suffix is dropped first)")
    return ap


def _pair(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{name} must be LO,HI, got {text!r}") from None
    if not 0 < lo <= hi:
        raise ValueError(f"--{name} must be 0 < LO <= HI, got {text!r}")
    return lo, hi


def server_args(args: argparse.Namespace) -> list[str]:
    slots = args.max_slots or int(args.users * 1.1) + 16
    out = ["--model", args.model, "--max-seq-len", str(args.max_seq_len), "--max-slots", str(slots),
           "--log-level", "warning"]
    for flag in ("device", "dtype", "api_workers"):
        if getattr(args, flag, None) is not None:
            out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return out + shlex.split(args.server_args or "")


def roles(args: argparse.Namespace) -> list[str]:
    """user index -> http | ws | voice, shuffled (seeded) so that the ramp starts every kind early."""
    n_voice = args.voice_users if args.voice_users is not None else max(1, args.users // 50)
    n_ws = round(args.users * args.ws_users)
    if n_voice + n_ws > args.users:
        raise ValueError(f"--users {args.users} is fewer than the voice users ({n_voice}) + WebSocket users ({n_ws})")
    out = ["voice"] * n_voice + ["ws"] * n_ws + ["http"] * (args.users - n_voice - n_ws)
    random.Random(args.seed).shuffle(out)
    return out


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, workers: list[Worker], events: queue.Queue,
                 server: ServerProcess | None, tree: ServerTree | None) -> None:
        self.args, self.url, self.workers, self.events, self.server, self.tree = args, url, workers, events, server, tree
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.records: list[list] = []
        self.samples: list[dict] = []
        self.results: list[dict] = []
        self.t0 = 0.0

    # ---- watching
    def sample(self, phase: str) -> None:
        if self.tree is None:
            return
        pids = list(self.tree.procs)
        self.samples.append({"t": round(time.monotonic() - self.t0, 1), "phase": phase, "rss": self.tree.memory(),
                             "gpu": gpu_memory(pids)})

    def pump(self, timeout: float) -> None:
        """Take the client processes' messages for up to `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                i, msg = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            kind = msg.get("event")
            if kind == "records":
                self.records += msg["records"]
            elif kind == "result":
                self.records += msg.pop("records")
                self.results.append(msg)
            elif kind == "exit":
                raise RuntimeError(f"client process {i} exited (see its stderr above)")

    def wait_ready_workers(self) -> None:
        ready, deadline = 0, time.monotonic() + 120
        while ready < len(self.workers) and time.monotonic() < deadline:
            try:
                _, msg = self.events.get(timeout=1.0)
            except queue.Empty:
                continue
            ready += msg.get("event") == "ready"
        if ready < len(self.workers):
            raise RuntimeError(f"only {ready} of {len(self.workers)} client processes started")

    # ---- the load
    def load(self, stored: list[str], run_id: str) -> tuple[float, float, str]:
        a = self.args
        who = roles(a)
        ramp = a.ramp if a.ramp is not None else min(10.0, a.duration / 10)
        every = a.sample_every or min(15.0, max(1.0, a.duration / 40))
        self.t0 = t_start = time.monotonic() + 1.0
        self.sample("idle")
        n = len(self.workers)
        for w in self.workers:
            mine = [[u, who[u]] for u in range(w.index, a.users, n)]
            w.send({"cmd": "soak", "url": self.url, "api_key": a.api_key, "t_start": t_start, "ramp": ramp,
                    "num_users": a.users, "users": mine, "texts": list(TEXTS), "voices": stored,
                    "formats": a.formats.split(","), "audio_ms": _pair(a.audio_ms, "audio-ms"),
                    "turns": _pair(a.turns, "turns"), "disconnect": a.disconnect, "hostile": a.hostile,
                    "keep_voices": a.keep_voices, "seed": a.seed, "run_id": run_id})
        t_end, next_sample, stopped_by = t_start + a.duration, t_start + ramp, "duration"
        next_note = t_start + 60.0
        while time.monotonic() < t_end:
            self.pump(0.5)
            self.check_server()
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
        for w in self.workers:
            w.send({"cmd": "stop"})
        deadline = time.monotonic() + 120
        while len(self.results) < n and time.monotonic() < deadline:
            self.pump(0.5)
        if len(self.results) < n:
            raise RuntimeError(f"only {len(self.results)} of {n} client processes reported")
        return ramp, load_end - t_start, stopped_by

    def progress(self) -> None:
        """A line a minute on stderr (what a run cut short still leaves)."""
        st, se = RECORD.index("status"), RECORD.index("server_error")
        failed = sum(r[st] not in ("ok", "cut") for r in self.records)
        server = sum(bool(r[se]) for r in self.records)
        rss = self.samples[-1]["rss"] if self.samples else {}
        gone = len(self.tree.exited()) if self.tree else "?"
        print(f"soak: {time.monotonic() - self.t0:.0f} s: {len(self.records)} requests, {failed} failed, {server} >= 500, "
              f"{gone} server processes exited; RSS MB {rss}", file=sys.stderr, flush=True)

    def check_server(self) -> None:
        if self.server is not None and not self.server.alive():
            raise RuntimeError(f"the server exited during the soak:\n{self.server.log_tail()}")

    def settle(self) -> dict:
        """The engine's gauges after the stop: how long until nothing runs or waits."""
        sampler, t, last = metrics.Sampler(self.url), time.monotonic(), None
        while True:
            s = sampler.scrape()
            if s is not None:
                last = (metrics.total(s, metrics.RUNNING), metrics.total(s, metrics.WAITING))
                if last == (0, 0):
                    break
            if time.monotonic() - t > self.args.settle:
                break
            time.sleep(0.1)
        return {"running": last[0] if last else None, "waiting": last[1] if last else None,
                "settle_s": round(time.monotonic() - t, 2)}

    # ---- voices after the load
    def check_voices(self, stored: list[str]) -> dict:
        import httpx

        live: dict[str, int] = {vid: 0 for vid in stored}
        deleted, uncertain = [], []
        for res in self.results:
            live.update(res["voices"]["live"])
            deleted += res["voices"]["deleted"]
            uncertain += res["voices"]["uncertain"]
        problems: list[str] = []
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
                g = c.get(f"/v1/audio/voices/{vid}")
                if g.status_code != 404:
                    problems.append(f"{vid}: deleted, GET answers HTTP {g.status_code}")
            if deleted:  # one speech request in a deleted voice
                r = c.post(SPEECH_PATH, json={**GOOD, "voice": deleted[-1]})
                if r.status_code != 404:
                    problems.append(f"{deleted[-1]}: deleted, speech answers HTTP {r.status_code}")
        created = len(live) - len(stored) + len(deleted)
        return {"stored": len(stored), "created": created, "deleted": len(deleted), "live_checked": len(live),
                "deleted_checked": len(deleted),
                "uncertain": len(uncertain), "problems": problems, "live_ids": sorted(live)}


def run(args: argparse.Namespace) -> dict:
    """The soak -> its summary (also written to --out, printed as markdown)."""
    if args.users < 1 or args.duration <= 0:
        raise ValueError("--users must be >= 1 and --duration > 0")
    for fmt in args.formats.split(","):
        if fmt not in ("pcm", "mp3", "opus", "wav", "flac", "aac"):
            raise ValueError(f"--formats: unknown format {fmt!r}")
    _pair(args.audio_ms, "audio-ms"), _pair(args.turns, "turns"), roles(args)
    procs = args.client_procs or default_client_procs()
    base = _out_base(args.out)
    raise_fd_limit()
    events: queue.Queue = queue.Queue()
    tmp = tempfile.TemporaryDirectory(prefix="csmserve-soak-")
    workers = [Worker(i, events, _child_env()) for i in range(procs)]
    server = None
    run_id = f"soak{int(time.time()) % 10**6}"
    stored: list[str] = []
    soak = None
    try:
        url, server = start_or_attach(args, server_args(args), base, tmp.name)
        if server is not None:
            root = server.proc.pid
        else:
            root = args.server_pid if args.server_pid and own_pid_ok(args.server_pid) else None
        tree = ServerTree(root) if root is not None else None
        if tree is not None:
            tree.start()
        soak = Soak(args, url, workers, events, server, tree)
        soak.wait_ready_workers()
        stored = create_voices(url, args.stored_voices, soak.headers, prefix=f"{run_id}-stored") \
            if args.stored_voices else []
        before = metrics.Sampler(url).scrape()
        print(f"soak: {args.users} users for {args.duration:g} s ({procs} client processes)", file=sys.stderr,
              flush=True)
        ramp, load_s, stopped_by = soak.load(stored, run_id)
        slots = soak.settle()
        voices = soak.check_voices(stored)
        soak.sample("after")
        after = metrics.Sampler(url).scrape()
        soak.check_server()
        crashes = {"exited": tree.exited() if tree else [], "appeared": tree.appeared() if tree else []}
        summary = summarize(soak.records, soak.t0, soak.t0 + load_s, args.window, len(CASES))
        summary.update({
            "meta": {"server": url if args.url else "csmserve serve " + " ".join(server_args(args)),
                     "commit": _commit(), "cores": os.cpu_count(), "client_procs": procs, "users": args.users,
                     "roles": {r: roles(args).count(r) for r in ("http", "ws", "voice")},
                     "duration_s": round(load_s, 1), "ramp_s": ramp, "stopped_by": stopped_by,
                     "server_processes": {str(p): n for p, n in tree.procs.items()} if tree else {},
                     "argv": sys.argv[1:],
                     "client_cpu_max": max((r["cpu_s"] / r["wall_s"] for r in soak.results if r["wall_s"]), default=None),
                     "client_lag_max_ms": max((r["loop_lag_max_ms"] for r in soak.results), default=None)},
            "slots_after": slots, "voices": voices, "crashes": crashes,
            "memory": memory_points(soak.samples, ramp + (args.warmup if args.warmup is not None
                                                          else min(60.0, args.duration / 4)), load_s)
            | {"samples": soak.samples},
            "server_5xx": None, "server_ttfa_ms": {"p50": None, "p99": None},
            "clients": [{k: v for k, v in r.items() if k != "voices"} for r in soak.results],
        })
        if before is not None and after is not None:
            errs = metrics._delta_by(before, after, "csmserve:request_errors_total", "status")
            summary["server_5xx"] = sum(v for k, v in errs.items() if k.startswith("5"))
            summary["server_errors_by_status"] = errs
            h = metrics.histogram_delta(before, after, metrics.TTFA)
            summary["server_ttfa_ms"] = {"p50": metrics._ms(metrics.quantile(h, 0.5)),
                                         "p99": metrics._ms(metrics.quantile(h, 0.99))}
        md = markdown(summary)
        print(md, flush=True)
        if base:
            base.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{base}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
            Path(f"{base}.md").write_text(md)
        return summary
    finally:
        if args.url and soak is not None:  # leave a running server as it was
            delete_voices(url, stored + [v for r in soak.results for v in r["voices"]["live"]], soak.headers)
        for w in workers:
            w.close()
        if server is not None:
            server.stop()
        tmp.cleanup()


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
