"""The server under test: `csmserve serve` started as a subprocess (or one already running, --url), readiness
(every Ray replica's too), stored voices made for the benchmark; and its processes: the tree under the `csmserve
serve` pid (parent, engine-core process, API workers; /proc, Linux), each one's resident memory and CPU, which of
them exited, and GPU memory."""
from __future__ import annotations

import os
import shutil
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from csmserve.ray.haproxy import raise_fd_limit

VOICE_TRANSCRIPT = "This is the reference clip of a benchmark voice, read at an even pace."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m csmserve serve --host 127.0.0.1 --port P ARGS...`, its output in `log_path`."""

    def __init__(self, args: list[str], log_path: str | Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "csmserve", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     *args]
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> str:
        raise_fd_limit()  # thousands of sockets: the server inherits the limit
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        # a session of its own: stop() can end every process it starts (API workers, an engine process)
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        try:
            wait_ready(self.url, timeout, self)
        except BaseException:
            self.stop()
            raise
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig) if sig == signal.SIGKILL else p.send_signal(sig)
            except ProcessLookupError:
                return
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # whatever it started and left behind in its session
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_ready(url: str, timeout: float, server: ServerProcess | None = None) -> None:
    """Until /ready answers 200 and, behind Ray, says every replica is ready (/health where there is no /ready)."""
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if server is not None and not server.alive():
            raise RuntimeError(f"the server exited (code {server.proc.returncode}) before it was ready:\n"
                               f"{server.log_tail()}")
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                reps = r.json().get("replicas") if r.headers.get("content-type", "").startswith("application/json") \
                    else None
                if not isinstance(reps, dict) or reps.get("ready", 0) >= reps.get("total", 0):
                    return
                last = f"{reps.get('ready')} of {reps.get('total')} replicas ready"
            elif r.status_code == 404 and httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return  # a server without /ready (e.g. behind a proxy)
            else:
                last = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError) as e:
            last = type(e).__name__
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready after {timeout:g} s ({last})"
                       + (f":\n{server.log_tail()}" if server is not None else ""))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the processes we start: this csmserve importable, whatever the cwd."""
    import csmserve

    root = str(Path(csmserve.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1"}
    return {**env, **(extra or {})}


def serve_args(args, **more) -> list[str]:
    """`csmserve serve` flags from a benchmark's: --model, --max-seq-len, those of --device, --dtype, --max-slots
    and --api-workers it has, `more` (name -> value), then --server-args."""
    out = ["--model", args.model, "--max-seq-len", str(args.max_seq_len), "--log-level", "warning"]
    given = {k: getattr(args, k, None) for k in ("device", "dtype", "max_slots", "api_workers")} | more
    for name, value in given.items():
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out + shlex.split(args.server_args or "")


def start_or_attach(args, serve: list[str], base: Path | None, tmpdir: str,
                    env: dict[str, str] | None = None) -> tuple[str, ServerProcess | None]:
    """-> (base URL, the server started or None): --url waits for that server to be ready; otherwise
    `csmserve serve <serve>` starts here (its log beside the results, OUT.server.log, its voices in tmpdir)."""
    if getattr(args, "url", None):
        url = args.url.rstrip("/").removesuffix("/v1")
        wait_ready(url, args.ready_timeout)
        return url, None
    log = f"{base}.server.log" if base else str(Path(tmpdir) / "server.log")
    voices = {} if os.environ.get("CSMSERVE_VOICES_DB") else {"CSMSERVE_VOICES_DB": str(Path(tmpdir) / "voices.db")}
    server = ServerProcess(serve, log, child_env({**voices, **(env or {})}))
    t = time.monotonic()
    print(f"starting: {' '.join(server.args[1:])} (log: {log})", file=sys.stderr, flush=True)
    server.start(args.ready_timeout)
    print(f"server ready in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    return server.url, server


def wav(channels: int = 1, rate: int = 24_000, seconds: float = 0.5, data: np.ndarray | None = None,
        extensible: bool = False, float32: bool = False) -> bytes:
    """A RIFF/WAVE file built byte by byte from `data` in [-1, 1] ([n] or [n, channels]; default a 220 Hz tone):
    any channel count, NaN floats, WAVE_FORMAT_EXTENSIBLE (what the soak's hostile uploads need)."""
    if data is None:
        tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(int(rate * seconds)) / rate)
        data = np.repeat(tone[:, None], channels, 1)  # [n, channels]
    tag, bits = (3, 32) if float32 else (1, 16)
    raw = np.asarray(data).astype("<f4").tobytes() if float32 else (np.asarray(data) * 32767).astype("<i2").tobytes()
    block = channels * bits // 8
    head = struct.pack("<HIIHH", channels, rate, rate * block, block, bits)
    fmt = (struct.pack("<H", 0xFFFE) + head + struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag)
           + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71") if extensible \
        else struct.pack("<H", tag) + head
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(raw)) + raw
    return b"RIFF" + struct.pack("<I", len(body)) + body


def voice_wav(seconds: float = 5.0, rate: int = 24_000, seed: int = 0) -> bytes:
    """A speech-like clip: a gliding harmonic tone with a syllable-rate envelope, 16-bit mono."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 20 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return wav(rate=rate, data=0.25 * tone * envelope / np.abs(tone).max())


def create_voices(url: str, n: int, headers: dict, prefix: str = "bench-voice") -> list[str]:
    """POST /v1/audio/voices n times (a generated clip each) -> their ids."""
    import httpx

    ids = []
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        for i in range(n):
            r = client.post("/v1/audio/voices", data={"name": f"{prefix}-{i}", "transcript": VOICE_TRANSCRIPT},
                            files={"audio_sample": (f"voice{i}.wav", voice_wav(seed=i), "audio/wav")})
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/audio/voices: HTTP {r.status_code}: {r.text[:200]}")
            ids.append(r.json()["id"])
    return ids


ADAPTER_PREFIX = "bench-lora"  # the benchmark's adapters: bench-lora-0 .. bench-lora-{N-1}


def adapter_names(n: int) -> list[str]:
    return [f"{ADAPTER_PREFIX}-{i}" for i in range(n)]


def write_adapters(model: str, n: int, rank: int, root: Path) -> Path:
    """n random LoRA adapters of `rank` on every projection of `model`'s shape (models/lora.py write_adapter: PEFT's
    files, PEFT-free), root/bench-lora-<i> -> root (the server's --lora-dir)."""
    import torch

    from csmserve.models.csm import CSMConfig
    from csmserve.models.loader import read_config, resolve_model_dir, tiny_config
    from csmserve.models.lora import write_adapter

    if model == "paced":
        raise ValueError("--model paced serves no LoRA adapters (it has no model): a scenario's adapters need one")
    cfg = {"dummy": CSMConfig, "dummy-tiny": tiny_config}.get(model)
    cfg = cfg() if cfg is not None else read_config(resolve_model_dir(model))
    t = time.monotonic()
    for i, name in enumerate(adapter_names(n)):
        write_adapter(root / name, cfg, rank=rank, seed=i, dtype=torch.bfloat16)
    print(f"{n} random rank-{rank} adapters written in {time.monotonic() - t:.1f} s ({root})", file=sys.stderr,
          flush=True)
    return root


def load_adapters(url: str, n: int, headers: dict) -> list[str]:
    """The benchmark's n adapters served by the server at `url` -> their names: each one it lists already (GET
    /v1/models) is kept, the others loaded through POST /v1/load_lora_adapter from its --lora-dir (a started server:
    write_adapters' directory; --url: one holding bench-lora-<i>)."""
    import httpx

    names = adapter_names(n)
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        listed = {m["id"] for m in client.get("/v1/models").json().get("data", [])}
        t = time.monotonic()
        for name in names:
            if name in listed:
                continue
            r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/load_lora_adapter {name}: HTTP {r.status_code}: {r.text[:300]} (the "
                                   f"server needs --lora-dir holding {ADAPTER_PREFIX}-<i>, and --max-lora-rank)")
    print(f"{n} adapters served ({time.monotonic() - t:.1f} s to load)", file=sys.stderr, flush=True)
    return names


def delete_voices(url: str, ids: list[str], headers: dict) -> None:
    import httpx

    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for vid in ids:
            try:
                client.delete(f"/v1/audio/voices/{vid}")
            except httpx.HTTPError:
                pass


# ---------------------------------------------------------------- its processes
PROC = Path("/proc")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """(comm, the fields after it: state, ppid, ...) from /proc/PID/stat; None if there is no such process."""
    text = _read(PROC / str(pid) / "stat")
    if text is None:
        return None
    return text[text.find("(") + 1:text.rfind(")")], text[text.rfind(")") + 2:].split()  # comm may hold ( ) and spaces


def alive(pid: int) -> bool:
    s = _stat(pid)
    return s is not None and s[1][0] not in ("Z", "X")


def rss_mb(pid: int) -> float | None:
    """VmRSS in MB (None: gone)."""
    for line in (_read(PROC / str(pid) / "status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def children(pid: int) -> list[int]:
    out = [int(c) for task in (PROC / str(pid) / "task").glob("*") for c in (_read(task / "children") or "").split()]
    if out or not (PROC / str(pid) / "task").exists():
        return sorted(set(out))
    # kernels without /proc/PID/task/TID/children: scan every process's parent
    return sorted(int(d.name) for d in PROC.iterdir()
                  if d.name.isdigit() and (s := _stat(int(d.name))) is not None and int(s[1][1]) == pid)


def descendants(root: int) -> list[int]:
    """`root` and every live process under it."""
    out, todo = [], [root]
    while todo:
        if alive(pid := todo.pop()):
            out.append(pid)
            todo += children(pid)
    return out


def label(pid: int, root: int) -> str | None:
    """parent / engine / api-N (each child names itself: server/processes.py sets /proc/PID/comm) / child-PID;
    None for multiprocessing's trackers (they hold no request state)."""
    if pid == root:
        return "parent"
    comm = (_read(PROC / str(pid) / "comm") or "").strip()
    if comm == "csmserve-engine":
        return "engine"
    if comm.startswith("csmserve-api-"):
        return "api-" + comm.removeprefix("csmserve-api-")
    cmdline = (_read(PROC / str(pid) / "cmdline") or "").replace("\0", " ")
    if "resource_tracker" in cmdline or "semaphore_tracker" in cmdline or "forkserver" in cmdline:
        return None
    return f"child-{pid}"


class ServerTree:
    """The processes under `root`, found at start(); `exited()` names each that has gone since,
    `appeared()` each new one (a restarted worker), `memory()` every live one's RSS."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.procs: dict[int, str] = {}  # pid -> label, as found by start()

    def scan(self) -> dict[int, str]:
        return {pid: name for pid in descendants(self.root) if (name := label(pid, self.root)) is not None}

    def start(self) -> dict[int, str]:
        self.procs = self.scan()
        return self.procs

    def exited(self) -> list[dict]:
        return [{"pid": pid, "process": name} for pid, name in self.procs.items() if not alive(pid)]

    def appeared(self) -> list[dict]:
        return [{"pid": pid, "process": name} for pid, name in self.scan().items() if pid not in self.procs]

    def memory(self) -> dict[str, float]:
        """{label: RSS MB} of every process found at start that still lives, and `total`."""
        out = {name: mb for pid, name in self.procs.items() if (mb := rss_mb(pid)) is not None}
        out["total"] = round(sum(out.values()), 1)
        return out


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def gpu_memory(pids: list[int]) -> dict | None:
    """{"processes_mb": MB used by these pids (nvidia-smi's compute apps; 0 when a container hides the
    pids), "device_used_mb": every process on GPU 0} or None without nvidia-smi."""
    if (exe := shutil.which("nvidia-smi")) is None:
        return None
    try:
        apps, used = (subprocess.run([exe, *q, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=20).stdout for q in (["--query-compute-apps=pid,used_memory"],
                                                                  ["--query-gpu=memory.used", "-i", "0"]))
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[x.strip() for x in line.split(",")] for line in apps.splitlines()]
    mine = sum(_float(r[1]) or 0.0 for r in rows if len(r) == 2 and r[0].isdigit() and int(r[0]) in pids)
    return {"processes_mb": mine, "device_used_mb": _float((used.split() or [""])[0])}


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (comm, user + system CPU seconds so far) for `root` and every process under it."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in descendants(root):
        if (s := _stat(pid)) is not None:  # fields 14, 15: utime, stime
            out[pid] = (s[0], (int(s[1][11]) + int(s[1][12])) / tick)
    return out


def cpu_cores(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float) -> dict:
    """CPU cores used between two `cpu_seconds` by the engine-core process, the API workers (total, busiest,
    least busy: how evenly the connections spread) and the rest of the tree."""
    used = {pid: (comm, (t - before[pid][1]) / seconds) for pid, (comm, t) in after.items() if pid in before}
    workers = sorted(c for comm, c in used.values() if comm.startswith("csmserve-api"))
    engine = sum(c for comm, c in used.values() if comm == "csmserve-engine")
    return {"engine": round(engine, 2), "workers": round(sum(workers), 2), "workers_n": len(workers),
            "worker_max": round(workers[-1], 2) if workers else None,
            "worker_min": round(workers[0], 2) if workers else None,
            "other": round(sum(c for _, c in used.values()) - engine - sum(workers), 2)}
