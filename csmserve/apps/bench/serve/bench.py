"""Orchestration: start `csmserve serve` (or use --url), start the client processes, run each scenario,
scrape the server's metrics around it, print the table, write JSON + markdown (--out), stop everything.
With --setup: the same scenarios against each setup's server in turn, side by side."""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from csmserve.apps.bench.serve import report, server as srv
from csmserve.apps.bench.serve.users import FORMATS, Scenario, parse_scenario
from csmserve.apps.common import bearer
from csmserve.ray.haproxy import raise_fd_limit

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
    # the measured TTFA); 8 lagged 14 (docs/notes/server-log.md)
    return max(1, min(12, (os.cpu_count() or 2) // 2))


def add_server_arguments(ap: argparse.ArgumentParser, shared: bool = False, max_slots: str = "its own") -> None:
    """The server under test's flags, shared with the soak. shared=True: inside `csmserve bench`, whose parser
    already has --model, --device, --dtype, --max-seq-len and --out (they mean the same here)."""
    g = ap.add_argument_group("the server (started here unless --url) and the clients")
    if not shared:
        g.add_argument("--model", default="dummy",
                       help="the server's --model (default: dummy, random full-size weights)")
        g.add_argument("--device", default=None, help="the server's --device (default: its own)")
        g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                       help="the server's --dtype (default: its own)")
        g.add_argument("--max-seq-len", type=int, default=512, help="the server's --max-seq-len (default: 512)")
        g.add_argument("--out", help="write OUT.json and OUT.md (a .json/.md suffix is dropped first; default: none)")
    g.add_argument("--url", default=None, help="a running server (e.g. http://host:8000, a Ray Serve endpoint): "
                                               "none is started and the model flags are not used (default: none)")
    g.add_argument("--max-slots", type=int, default=None, help=f"the server's --max-slots (default: {max_slots})")
    g.add_argument("--server-args", default="", help="more `csmserve serve` flags, one string (e.g. "
                                                     "\"--api-workers 4 --prefix-cache-bytes 0\"; default: none)")
    g.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds to wait for the server's /ready (default: 900)")
    g.add_argument("--api-key", default=os.environ.get("CSMSERVE_API_KEY"),
                   help="the server's Bearer key (default: $CSMSERVE_API_KEY, else none)")
    g.add_argument("--client-procs", type=int, default=None,
                   help=f"client processes running the users (default: cores / 2, here {default_client_procs()})")


def add_arguments(ap: argparse.ArgumentParser, shared: bool = False) -> argparse.ArgumentParser:
    """The load benchmark's flags (see add_server_arguments for `shared`)."""
    add_server_arguments(ap, shared)
    g = ap.add_argument_group("the load (csmserve bench --serve)")
    g.add_argument("--scenario", action="append", default=None, metavar="SPEC",
                   help="MODE[:key=value,...], repeatable; MODE closed | burst | ws; keys users, format, ramp, "
                        "warmup, duration, within, audio_ms, voices, adapters, fresh, label (default: closed, with "
                        "the flags below). E.g. closed:users=2048  burst:users=2048,within=3  ws:users=1024,fresh=1  "
                        "closed:users=1024,adapters=64 (users spread over 64 random LoRA adapters)")
    g.add_argument("--users", type=int, default=64, help="concurrent users of a scenario (default: 64)")
    g.add_argument("--format", default="pcm", choices=FORMATS, help="a scenario's response_format (default: pcm)")
    g.add_argument("--ramp", type=float, default=10.0,
                   help="closed/ws: users start spread over this many seconds (default: 10)")
    g.add_argument("--warmup", type=float, default=2.0,
                   help="closed/ws: seconds after the ramp before the measured window (default: 2)")
    g.add_argument("--duration", type=float, default=20.0, help="closed/ws: the measured window's seconds "
                                                                "(default: 20)")
    g.add_argument("--audio-ms", type=int, default=10_000, help="max_audio_length_ms of each request (default: 10000)")
    g.add_argument("--lora-rank", type=int, default=16,
                   help="a scenario's adapters=N: N random LoRA adapters of this rank on every projection, written "
                        "for the server's model and loaded through POST /v1/load_lora_adapter (the server started "
                        "here gets --lora-dir, --max-loras N and --max-lora-rank this; default: 16)")
    g.add_argument("--drain", type=float, default=30.0, help="after the window, seconds to wait for the counted "
                                                             "requests to end (the load goes on; default: 30)")
    g.add_argument("--trace", nargs="?", const="", default=None, metavar="DIR",
                   help="start the server with --trace-requests into DIR (OUT.trace or a temp dir when not named) "
                        "and print bench/trace_report.py's table for each scenario's window (also OUT.trace.txt); "
                        "with --url: the DIR that server was started with (default: off)")
    g.add_argument("--setup", action="append", default=None, metavar="NAME=FLAGS",
                   help="a server setup: NAME=more `csmserve serve` flags; repeatable: the scenarios run against "
                        "each in turn, side by side, requests/s against the first's (default: one server)")
    return ap


def scenarios_of(args: argparse.Namespace) -> list[Scenario]:
    defaults = Scenario(users=args.users, format=args.format, ramp=args.ramp, warmup=args.warmup,
                        duration=args.duration, audio_ms=args.audio_ms)
    return [parse_scenario(s, defaults) for s in args.scenario] if args.scenario else [defaults]


def out_base(out: str | None) -> Path | None:
    if not out:
        return None
    p = Path(out)
    return p.with_suffix("") if p.suffix in (".json", ".md") else p


def commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


class Clients:
    """The client processes (client.py); their stdout lines arrive in `events` as (index, message)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"--client-procs must be >= 1, got {n}")
        self.events: queue.Queue = queue.Queue()
        self.procs = [subprocess.Popen([sys.executable, "-m", "csmserve.apps.bench.serve.client"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, bufsize=1, env=srv.child_env())
                      for _ in range(n)]
        for i, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()

    def _read(self, i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                self.events.put((i, json.loads(line)))
            except ValueError:
                print(f"client {i}: {line.rstrip()}", file=sys.stderr)
        self.events.put((i, {"event": "exit"}))

    def send(self, i: int, msg: dict) -> None:
        self.procs[i].stdin.write(json.dumps(msg) + "\n")
        self.procs[i].stdin.flush()

    def messages(self, deadline: float, server: srv.ServerProcess | None = None):
        """(index, message) as they come until `deadline`; a client or the server gone: an error."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                i, msg = self.events.get(timeout=min(0.5, left))
            except queue.Empty:
                if server is not None and not server.alive():
                    raise RuntimeError(f"the server exited during the run:\n{server.log_tail()}") from None
                continue
            if msg.get("event") == "exit":
                raise RuntimeError(f"client process {i} exited (see its stderr above)")
            yield i, msg

    def wait(self, kind: str, count: int, deadline: float, server: srv.ServerProcess | None = None
             ) -> list[tuple[int, dict]]:
        """Up to `count` messages of `kind` (others dropped) until `deadline`."""
        got: list[tuple[int, dict]] = []
        for i, msg in self.messages(deadline, server) if count else ():
            if msg.get("event") == kind:
                got.append((i, msg))
                if len(got) == count:
                    break
        return got

    def ready(self) -> None:
        if (n := len(self.wait("ready", len(self.procs), time.monotonic() + 120))) < len(self.procs):
            raise RuntimeError(f"only {n} of {len(self.procs)} client processes started")

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            try:
                self.send(i, {"cmd": "exit"})
                p.stdin.close()
                p.wait(15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                p.kill()
                p.wait(5)


def settle(url: str, timeout: float = 30.0, patient: bool = False) -> tuple[float, float] | None:
    """Wait until the server runs and queues nothing -> its (running, waiting) gauges at the end. A first scrape
    that fails: no /metrics there, unless `patient` (then every scrape is tried until the timeout)."""
    sampler, deadline, last = report.Sampler(url), time.monotonic() + timeout, None
    while True:
        if (s := sampler.scrape()) is not None:
            last = (report.total(s, report.RUNNING), report.total(s, report.WAITING))
        elif last is None and not patient:
            return None
        if last == (0, 0) or time.monotonic() > deadline:
            return last
        time.sleep(0.1)


class Bench:
    def __init__(self, args: argparse.Namespace, url: str, clients: Clients, server: srv.ServerProcess | None) -> None:
        self.args, self.url, self.clients, self.server = args, url, clients, server
        self.headers = bearer(args.api_key)
        self.voices: list[str] = []
        self.adapters: list[str] = []

    def _cpu_window(self, t0: float, t1: float, out: dict) -> None:
        time.sleep(max(0.0, t0 - time.monotonic()))
        before = srv.cpu_seconds(self.server.proc.pid)
        time.sleep(max(0.0, t1 - time.monotonic()))
        out["cores"] = srv.cpu_cores(before, srv.cpu_seconds(self.server.proc.pid), t1 - t0)

    def run(self, sc: Scenario) -> dict:
        settle(self.url)
        n = len(self.clients.procs)
        shares = [(i, users) for i in range(n) if (users := list(range(i, sc.users, n)))]
        sampler = report.Sampler(self.url)
        before = sampler.scrape()
        t_start = time.monotonic() + 1.0
        sampler.start()
        for i, users in shares:
            self.clients.send(i, {"cmd": "run", "scenario": dataclasses.asdict(sc), "users": users,
                                  "t_start": t_start, "url": self.url, "texts": list(SENTENCES),
                                  "voices": self.voices[:sc.voices], "api_key": self.args.api_key,
                                  "adapters": self.adapters[:sc.adapters]})
        t0, t1 = sc.window(t_start)
        cpu: dict = {}
        if self.server is not None:  # the server's CPU over the window
            threading.Thread(target=self._cpu_window, args=(t0, t1, cpu), daemon=True).start()
        after = None
        try:
            self.clients.wait("drained", len(shares), t1 + self.args.drain, self.server)
            t_drained = time.monotonic()
            after = sampler.scrape()  # before the stop: requests cut by it are no server error
        finally:
            for i, _ in shares:
                self.clients.send(i, {"cmd": "stop"})
            results = self.clients.wait("result", len(shares), time.monotonic() + 120)
            sampler.stop()
        if len(results) < len(shares):
            raise RuntimeError(f"only {len(results)} of {len(shares)} client processes reported")
        server = report.server_summary(before, after, sampler.samples, t0, t1)
        if server is not None and cpu.get("cores"):
            server["cpu"] = cpu["cores"]
        summary = report.summarize(sc, [r for _, m in results for r in m["records"]], t_start,
                                   [m for _, m in results], server)
        if self.args.trace_dir is not None:  # the requests received in the window (perf_counter = monotonic)
            from csmserve.apps.bench.serve import trace_report

            time.sleep(max(0.0, t_drained + 1.0 - time.monotonic()))  # flushed: 2 x engine/trace.py FLUSH_S
            summary["trace"] = trace_report.report(self.args.trace_dir, t0, t1)
        return summary


@contextlib.contextmanager
def session(args: argparse.Namespace, serve: Callable[[Path], list[str]], base: Path | None, prefix: str,
            env: dict[str, str] | None = None) -> Iterator[tuple[str, srv.ServerProcess | None, Clients]]:
    """`csmserve serve` with serve(a temp dir)'s flags started (or --url) and the client processes ready ->
    (its URL, the server started or None, the clients); all stopped after."""
    raise_fd_limit()
    # a SIGTERM (timeout, a cancelled CI job, docker stop) ends the run through the finally below: the server
    # (its own session) and the clients would otherwise go on loading each other
    term = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = clients = None
        try:
            url, server = srv.start_or_attach(args, serve(Path(tmp)), base, tmp, env)
            clients = Clients(args.client_procs or default_client_procs())
            clients.ready()
            yield url, server, clients
        finally:
            if clients is not None:
                clients.close()
            if server is not None:
                server.stop()
            if term is not None:
                signal.signal(signal.SIGTERM, term)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Every scenario against one server: the table printed, JSON and markdown written to --out."""
    if args.setup:
        return compare(args)
    scenarios, lines = scenarios_of(args), []  # (a bad spec: an error before anything starts)
    base = out_base(args.out)
    if args.trace is None:
        args.trace_dir = None
    elif args.trace:
        args.trace_dir = Path(args.trace)
    elif args.url:
        raise ValueError("--trace with --url needs the directory that server writes its trace to (--trace DIR)")
    else:
        args.trace_dir = Path(f"{base}.trace") if base else Path(tempfile.mkdtemp(prefix="csmserve-trace-"))
    adapters = max(s.adapters for s in scenarios)

    def serve(tmp: Path) -> list[str]:
        lora = {}
        if adapters and not args.url:  # random adapters for the server started here: loaded at run time
            root = srv.write_adapters(args.model, adapters, args.lora_rank, tmp / "loras")
            lora = {"lora_dir": root, "max_loras": adapters, "max_lora_rank": args.lora_rank}
        return srv.serve_args(args, trace_requests=args.trace_dir, **lora) + getattr(args, "setup_flags", [])

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    with session(args, serve, base, "csmserve-bench-", getattr(args, "setup_env", None)) as (url, server, clients):
        bench = Bench(args, url, clients, server)
        try:
            if (most := max(s.voices for s in scenarios)) > 0:
                bench.voices = srv.create_voices(url, most, bench.headers)
            if adapters > 0:
                bench.adapters = srv.load_adapters(url, adapters, bench.headers)
            shown = url if server is None else "csmserve serve " + " ".join(server.args[4:])
            emit(f"server: {shown}; commit {commit()}; {len(clients.procs)} client processes on {os.cpu_count()} "
                 "cores")
            emit()
            emit(report.HEADER)
            results = []
            for sc in scenarios:
                t = time.monotonic()
                results.append(bench.run(sc) | {"elapsed_s": round(time.monotonic() - t, 1)})
                emit(report.row(results[-1]))
            emit()
            for s in results:
                emit(f"- {report.details(s)} ({s['elapsed_s']} s)")
            # --trace: each scenario's trace_report (computed after it ran, over its window), after the table
            traces = [line for s in results if "trace" in s
                      for line in ["", f"### trace: {s['name']}", "", "```", *s["trace"], "```"]]
            for line in traces:
                emit(line)
            if base:
                base.parent.mkdir(parents=True, exist_ok=True)
                if traces:
                    Path(f"{base}.trace.txt").write_text("\n".join(traces) + "\n")
                meta = {"url": url, "server_args": server.args[4:] if server else None,
                        "client_procs": len(clients.procs), "cores": os.cpu_count(), "commit": commit()}
                Path(f"{base}.json").write_text(json.dumps({"meta": meta, "scenarios": results}, indent=1) + "\n")
                Path(f"{base}.md").write_text("\n".join(lines) + "\n")
        finally:
            if bench.voices and server is None:  # leave a running server as it was
                srv.delete_voices(url, bench.voices, bench.headers)
    return 0


def compare(args: argparse.Namespace) -> int:
    """Each --setup's server started, made fully ready (every Ray replica), measured, stopped before the next:
    each setup's own table, then per scenario a row per setup (report.table)."""
    if args.url:
        raise ValueError("--setup starts each setup's server itself: no --url")
    setups = []
    for spec in args.setup:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--setup must be NAME=FLAGS, got {spec!r}")
        setups.append((name.strip(), shlex.split(flags)))
    if len({n for n, _ in setups}) != len(setups):
        raise ValueError("--setup names must differ")
    base = out_base(args.out)
    results = []
    with tempfile.TemporaryDirectory(prefix="csmserve-compare-") as tmp:
        for name, flags in setups:
            sub = copy.copy(args)
            sub.setup, sub.trace, sub.setup_flags = None, None, flags
            sub.out = f"{base or Path(tmp) / 'compare'}.{name}"
            sub.setup_env = {"RAY_USAGE_STATS_ENABLED": "0"}
            print(f"\n### {name}\n", flush=True)
            run(sub)
            results.append((name, json.loads(Path(f"{sub.out}.json").read_text())["scenarios"]))
    lines = ["", f"### side by side ({', '.join(n for n, _ in setups)}; commit {commit()}, {os.cpu_count()} cores)",
             "", *report.table(results)]
    print("\n".join(lines), flush=True)
    if base:
        Path(f"{base}.md").write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None, prog: str = "serve_bench") -> int:
    ap = add_arguments(argparse.ArgumentParser(
        prog=prog, description="Load through the real server: closed loop, bursts, every format, the WebSocket; "
                               "with --setup, several servers side by side. csmserve/apps/bench/serve/."))
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
