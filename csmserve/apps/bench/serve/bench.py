"""Orchestration: start `csmserve serve` (or use --url), start the client processes, run each scenario,
scrape the server's metrics around it, print the table, write JSON + markdown (--out), stop everything."""
from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from csmserve.apps.bench.serve import metrics, report, tree
from csmserve.apps.bench.serve.scenario import FORMATS, Scenario, parse_scenario
from csmserve.apps.bench.serve.server import ServerProcess, create_voices, delete_voices, raise_fd_limit, wait_ready

# one sentence each, about 10 s spoken (what max_audio_length_ms 10000 allows), at most 25 words so that
# the server's splitter (csmserve/prompt/segments.py) keeps it one segment
SENTENCES = (
    "The morning train was late again, so I walked along the river and watched the fog lift from the water.",
    "If you want the report by Friday, send me the numbers tonight and I will check every table again.",
    "She opened the old wooden box and found a bundle of letters, a silver key, and a faded photograph.",
    "Thanks for calling back so quickly, I only wanted to confirm that the delivery is still planned for Tuesday.",
    "When the storm finally passed, the neighbours came out to clear the branches and share hot coffee together.",
    "Our new schedule starts next week, with the early shift beginning at seven and a short meeting every Monday.",
    "He said the recipe needs fresh basil, ripe tomatoes and a little patience, because the sauce simmers for hours.",
    "Before you leave, please switch off the lights in the studio, lock the back door, and leave the keys downstairs.",
)


def default_client_procs() -> int:
    # cores / 2: on the H200's 16 cores, 4 processes for 2,048 pcm users lagged 40 ms at p99 (their own share of
    # the measured TTFA); 8 lagged 14 (docs/benchmarks.md, the server under load, run 4)
    return max(1, min(12, (os.cpu_count() or 2) // 2))


def add_arguments(ap: argparse.ArgumentParser, shared: bool = False) -> argparse.ArgumentParser:
    """The load benchmark's flags. shared=True: inside `csmserve bench`, whose parser already has
    --model, --device, --dtype, --max-seq-len and --out (they mean the same here)."""
    if not shared:
        ap.add_argument("--model", default="dummy",
                        help="the server's --model (default dummy: random full-size weights)")
        ap.add_argument("--device", default=None, help="the server's --device")
        ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="the server's --dtype")
        ap.add_argument("--max-seq-len", type=int, default=512, help="the server's --max-seq-len (default 512)")
        ap.add_argument("--out", help="write OUT.json and OUT.md (a .json/.md suffix is dropped first)")
    g = ap.add_argument_group("load through the server (csmserve bench --serve)")
    g.add_argument("--url", default=None, help="a running server (e.g. http://host:8000, a Ray Serve endpoint): "
                                              "none is started and the model flags are not used")
    g.add_argument("--max-slots", type=int, default=None, help="the server's --max-slots")
    g.add_argument("--server-args", default="", help="more `csmserve serve` flags, one string "
                                                     "(e.g. \"--api-workers 4 --prefix-cache-bytes 0\")")
    g.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /ready (default 900)")
    g.add_argument("--server-log", default=None, help="the server's output (default: OUT.server.log or a temp file)")
    g.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"), help="Bearer key [env CSMSERVE_API_KEY]")
    g.add_argument("--scenario", action="append", default=None, metavar="SPEC",
                   help="MODE[:key=value,...], repeatable; MODE closed | burst | ws; keys users, format, ramp, "
                        "warmup, duration, within, audio_ms, voices, fresh, label (default: the flags below). "
                        "E.g. closed:users=2048  burst:users=2048,within=3  ws:users=1024,fresh=1")
    g.add_argument("--users", type=int, default=64, help="concurrent users (default 64)")
    g.add_argument("--format", default="pcm", choices=FORMATS, help="response_format (default pcm)")
    g.add_argument("--mode", default="closed", choices=["closed", "burst", "ws"],
                   help="the scenario when no --scenario is given (default closed)")
    g.add_argument("--ramp", type=float, default=10.0,
                   help="closed/ws: users start spread over this many s (default 10)")
    g.add_argument("--warmup", type=float, default=2.0,
                   help="closed/ws: s after the ramp before the window (default 2)")
    g.add_argument("--duration", type=float, default=20.0, help="closed/ws: the measured window in s (default 20)")
    g.add_argument("--within", type=float, default=3.0, help="burst: the arrivals spread over this many s (default 3)")
    g.add_argument("--audio-ms", type=int, default=10_000, help="max_audio_length_ms of each request (default 10000)")
    g.add_argument("--voices", type=int, default=0, help="create this many stored voices; user u speaks voice u %% N")
    g.add_argument("--fresh-context", action="store_true", help="ws: a new context_id per turn")
    g.add_argument("--drain", type=float, default=30.0,
                   help="after the window, s to wait for the counted requests to end (the load goes on; default 30)")
    g.add_argument("--client-procs", type=int, default=None,
                   help=f"client processes (default cores / 2, here {default_client_procs()})")
    g.add_argument("--text", default=None, help="the input of every request (default: a rotation of 10 s sentences)")
    g.add_argument("--backoff", type=float, default=0.25, help="s a user waits after an error (default 0.25)")
    g.add_argument("--ws-compression", action="store_true", help="offer permessage-deflate (default: off)")
    g.add_argument("--trace", nargs="?", const="", default=None, metavar="DIR",
                   help="start the server with --trace-requests into DIR (default OUT.trace, or a temp dir) and "
                        "print bench/trace_report.py's table for each scenario's window (also OUT.trace.txt); "
                        "with --url: the DIR that server was started with")
    g.add_argument("--save-records", action="store_true",
                   help="also write OUT.records.json: every request's record (csmserve/apps/bench/serve/users.py)")
    return ap


def scenarios_of(args: argparse.Namespace) -> list[Scenario]:
    defaults = Scenario(mode=args.mode, users=args.users, format=args.format, ramp=args.ramp, warmup=args.warmup,
                        duration=args.duration, within=args.within, audio_ms=args.audio_ms, voices=args.voices,
                        fresh=args.fresh_context)
    return [parse_scenario(s, defaults) for s in args.scenario] if args.scenario else [defaults]


def _out_base(out: str | None) -> Path | None:
    if not out:
        return None
    p = Path(out)
    return p.with_suffix("") if p.suffix in (".json", ".md") else p


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the processes we start: this csmserve importable, whatever the cwd."""
    import csmserve

    root = str(Path(csmserve.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1"}
    return {**env, **(extra or {})}


def server_args(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model, "--max-seq-len", str(args.max_seq_len), "--log-level", "warning"]
    for flag in ("device", "dtype", "max_slots"):
        if getattr(args, flag, None) is not None:
            out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if getattr(args, "trace_dir", None):
        out += ["--trace-requests", str(args.trace_dir)]
    return out + shlex.split(args.server_args or "")


def trace_dir(args: argparse.Namespace, base: Path | None) -> Path | None:
    """--trace: where the server's per-request timelines go (engine/trace.py); None: not traced."""
    if args.trace is None:
        return None
    if args.trace:
        return Path(args.trace)
    if args.url:
        raise ValueError("--trace with --url needs the directory that server writes its trace to (--trace DIR)")
    return Path(f"{base}.trace") if base else Path(tempfile.mkdtemp(prefix="csmserve-trace-"))


def start_or_attach(args: argparse.Namespace, serve_args: list[str], base: Path | None,
                    tmpdir: str) -> tuple[str, ServerProcess | None]:
    """-> (base URL, the server started or None): --url waits for that server to be ready; otherwise
    `csmserve serve <serve_args>` starts here (its log beside the results, its voices in tmpdir)."""
    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
        wait_ready(url, args.ready_timeout)
        return url, None
    log = args.server_log or (f"{base}.server.log" if base else str(Path(tmpdir) / "server.log"))
    env = _child_env({} if os.environ.get("CSMSERVE_VOICES_DB")
                     else {"CSMSERVE_VOICES_DB": str(Path(tmpdir) / "voices.db")})
    server = ServerProcess(serve_args, log, env)
    t = time.monotonic()
    print(f"starting: {' '.join(server.args[1:])} (log: {log})", file=sys.stderr, flush=True)
    try:
        url = server.start(args.ready_timeout)
    except BaseException:
        server.stop()  # never ready: nothing of it is left running
        raise
    print(f"server ready in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    return url, server


class Worker:
    """One client process; its stdout lines arrive in the shared `events` queue as (index, message)."""

    def __init__(self, index: int, events: queue.Queue, env: dict[str, str]) -> None:
        self.index = index
        self.proc = subprocess.Popen([sys.executable, "-m", "csmserve.apps.bench.serve.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: queue.Queue) -> None:
        for line in self.proc.stdout:
            try:
                events.put((self.index, json.loads(line)))
            except ValueError:
                print(f"client {self.index}: {line.rstrip()}", file=sys.stderr)
        events.put((self.index, {"event": "exit"}))

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.send({"cmd": "exit"})
            self.proc.stdin.close()
            self.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
            self.proc.wait(5)


class Bench:
    def __init__(self, args: argparse.Namespace, url: str, workers: list[Worker], events: queue.Queue,
                 server: ServerProcess | None) -> None:
        self.args, self.url, self.workers, self.events, self.server = args, url, workers, events, server
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.texts = [args.text] if args.text else list(SENTENCES)
        self.voices: list[str] = []

    def wait_events(self, kind: str, count: int, deadline: float) -> list[tuple[int, dict]]:
        got: list[tuple[int, dict]] = []
        while len(got) < count and time.monotonic() < deadline:
            try:
                i, msg = self.events.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if self.server is not None and not self.server.alive():
                    raise RuntimeError(f"the server exited during the run:\n{self.server.log_tail()}") from None
                continue
            if msg.get("event") == kind:
                got.append((i, msg))
            elif msg.get("event") == "exit":
                raise RuntimeError(f"client process {i} exited (see its stderr above)")
        return got

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until the server runs and queues nothing (the last scenario's streams are gone)."""
        sampler = metrics.Sampler(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = sampler.scrape()
            if s is None or metrics.total(s, metrics.RUNNING) + metrics.total(s, metrics.WAITING) == 0:
                return
            time.sleep(0.2)

    @staticmethod
    def _cpu_window(pid: int, t0: float, t1: float, out: dict) -> None:
        time.sleep(max(0.0, t0 - time.monotonic()))
        before = tree.cpu_seconds(pid)
        time.sleep(max(0.0, t1 - time.monotonic()))
        out["cores"] = tree.cpu_cores(before, tree.cpu_seconds(pid), t1 - t0)

    def run(self, sc: Scenario) -> dict:
        self.settle()
        n = len(self.workers)
        shares = [(w, list(range(w.index, sc.users, n))) for w in self.workers]
        shares = [(w, users) for w, users in shares if users]
        sampler = metrics.Sampler(self.url)
        before = sampler.scrape()
        t_start = time.monotonic() + 1.0
        sampler.start()
        voices = self.voices[:sc.voices] if sc.voices else []
        for w, users in shares:
            w.send({"cmd": "run", "scenario": sc.to_dict(), "users": users, "t_start": t_start, "url": self.url,
                    "texts": self.texts, "voices": voices, "api_key": self.args.api_key,
                    "backoff": self.args.backoff, "ws_compression": self.args.ws_compression})
        t0, t1 = sc.window(t_start)
        cpu: dict = {}
        if self.server is not None and self.server.proc is not None:  # the server's CPU over the window
            threading.Thread(target=self._cpu_window, args=(self.server.proc.pid, t0, t1, cpu), daemon=True).start()
        after = None
        try:
            self.wait_events("drained", len(shares), t1 + self.args.drain)
            t_drained = time.monotonic()
            after = sampler.scrape()  # before the stop: requests cut by it are no server error
        finally:
            for w, _ in shares:
                w.send({"cmd": "stop"})
            results = self.wait_events("result", len(shares), time.monotonic() + 120)
            sampler.stop()
        if len(results) < len(shares):
            raise RuntimeError(f"only {len(results)} of {len(shares)} client processes reported")
        records = [r for _, msg in results for r in msg["records"]]
        server = metrics.summarize(before, after, sampler.samples, t0, t1)
        if server is not None and cpu.get("cores"):
            server["cpu"] = cpu["cores"]
        summary = report.summarize(sc, records, t_start, [msg for _, msg in results], server)
        if getattr(self.args, "trace_dir", None) is not None:  # the requests received in the window (perf_counter = monotonic)
            from csmserve.apps.bench.serve import trace_report

            time.sleep(max(0.0, t_drained + 1.0 - time.monotonic()))  # flushed: 2 x engine/trace.py FLUSH_S
            summary["trace"] = trace_report.report(self.args.trace_dir, t0, t1)
        if self.args.save_records:
            summary["records"] = records
        return summary


def run(args: argparse.Namespace, server: ServerProcess | None = None) -> int:
    """server: one already started (and left running) to measure, with its CPU (compare.py); else --url's or
    the one started here from the flags."""
    scenarios = scenarios_of(args)
    own = server is None
    procs = args.client_procs or default_client_procs()
    if procs < 1:
        raise ValueError(f"--client-procs must be >= 1, got {procs}")
    base = _out_base(args.out)
    args.trace_dir = trace_dir(args, base)
    raise_fd_limit()
    events: queue.Queue = queue.Queue()
    workers = [Worker(i, events, _child_env()) for i in range(procs)]
    tmp = tempfile.TemporaryDirectory(prefix="csmserve-bench-")
    bench = None
    lines: list[str] = []

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    try:
        url, server = start_or_attach(args, server_args(args), base, tmp.name) if own else (server.url, server)
        bench = Bench(args, url, workers, events, server)
        ready = bench.wait_events("ready", procs, time.monotonic() + 120)
        if len(ready) < procs:
            raise RuntimeError(f"only {len(ready)} of {procs} client processes started")
        if max((s.voices for s in scenarios), default=0):
            bench.voices = create_voices(url, max(s.voices for s in scenarios), bench.headers)
        shown = ' '.join(server.args[4:]) if not own else url if args.url else ' '.join(server_args(args))
        emit(f"server: {url if own and args.url else 'csmserve serve ' + shown}; "
             f"commit {_commit()}; {procs} client processes on {os.cpu_count()} cores")
        emit()
        emit(report.HEADER)
        results = []
        for sc in scenarios:
            t = time.monotonic()
            s = bench.run(sc)
            s["elapsed_s"] = round(time.monotonic() - t, 1)
            results.append(s)
            emit(report.row(s))
        emit()
        for s in results:
            emit(f"- {report.details(s)} ({s['elapsed_s']} s)")
        # --trace: each scenario's trace_report (computed after it ran, over its window), after the table
        traces = [line for s in results if "trace" in s for line in ["", f"### trace: {s['name']}", "", "```",
                                                                     *s["trace"], "```"]]
        for line in traces:
            emit(line)
        if traces and base:
            base.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{base}.trace.txt").write_text("\n".join(traces) + "\n")
        if base:
            base.parent.mkdir(parents=True, exist_ok=True)
            meta = {"url": url, "server_args": server.args[4:] if not own else None if args.url else server_args(args),
                    "client_procs": procs,
                    "cores": os.cpu_count(), "commit": _commit()}
            if args.save_records:
                from csmserve.apps.bench.serve.users import RECORD

                Path(f"{base}.records.json").write_text(json.dumps(
                    {"columns": RECORD, "scenarios": [{"name": s["name"], "t_start": s["t_start"],
                                                       "records": s.pop("records")} for s in results]}) + "\n")
            Path(f"{base}.json").write_text(json.dumps({"meta": meta, "scenarios": results}, indent=1) + "\n")
            Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    finally:
        if bench is not None and bench.voices and args.url:
            delete_voices(url, bench.voices, bench.headers)
        for w in workers:
            w.close()
        if server is not None and own:
            server.stop()
        tmp.cleanup()
    return 0


def _commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = add_arguments(argparse.ArgumentParser(
        prog="serve_bench", description="Load through the real server: closed loop, bursts, every format, "
                                        "the WebSocket. csmserve/apps/bench/serve/."))
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"serve_bench: error: {e}", file=sys.stderr)
        return 2
