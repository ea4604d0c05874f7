"""The server under test as processes: the tree under the `csmserve serve` pid (parent, engine-core process,
API workers; /proc, Linux), each one's resident memory, which of them exited, and GPU memory.

Each child names itself (csmserve/server/processes.py: /proc/PID/comm `csmserve-engine`, `csmserve-api-N`);
multiprocessing's resource tracker is left out (it holds no request state).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

PROC = Path("/proc")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/PID/stat; None if there is no such process."""
    text = _read(PROC / str(pid) / "stat")
    if text is None:
        return None
    fields = text[text.rfind(")") + 2:].split()  # comm may hold spaces and parentheses
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    s = _stat(pid)
    return s is not None and s[0] not in ("Z", "X")


def rss_mb(pid: int) -> float | None:
    """VmRSS in MB (None: gone)."""
    for line in (_read(PROC / str(pid) / "status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def children(pid: int) -> list[int]:
    out = []
    for task in (PROC / str(pid) / "task").glob("*"):
        text = _read(task / "children")
        if text:
            out += [int(c) for c in text.split()]
    if out or not (PROC / str(pid) / "task").exists():
        return sorted(set(out))
    # kernels without /proc/PID/task/TID/children: scan every process's parent
    for d in PROC.iterdir():
        if d.name.isdigit() and (s := _stat(int(d.name))) is not None and s[1] == pid:
            out.append(int(d.name))
    return sorted(out)


def label(pid: int, root: int) -> str | None:
    """parent / engine / api-N / child; None for multiprocessing's trackers."""
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
        found, todo = {}, [self.root]
        while todo:
            pid = todo.pop()
            if not alive(pid):
                continue
            name = label(pid, self.root)
            if name is not None:
                found[pid] = name
            todo += children(pid)
        return found

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


def gpu_memory(pids: list[int]) -> dict | None:
    """{"processes_mb": MB used by these pids (nvidia-smi's compute apps; 0 when a container hides the
    pids), "device_used_mb": every process on GPU 0} or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        apps = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        used = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mine = 0.0
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            try:
                mine += float(parts[1])
            except ValueError:
                pass
    try:
        device = float(used.split()[0])
    except (IndexError, ValueError):
        device = None
    return {"processes_mb": mine, "device_used_mb": device}


def own_pid_ok(pid: int) -> bool:
    """A pid given with --server-pid can be read here (same machine, same pid namespace)."""
    return os.path.isdir(PROC / str(pid)) and alive(pid)


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (comm, user + system CPU seconds so far) for `root` and every process under it."""
    tick, out, stack = os.sysconf("SC_CLK_TCK"), {}, [root]
    while stack:
        pid = stack.pop()
        text = _read(PROC / str(pid) / "stat")
        if text is None:
            continue
        f = text[text.rfind(")") + 2:].split()  # f[11], f[12]: utime, stime (stat fields 14, 15)
        out[pid] = (text[text.find("(") + 1:text.rfind(")")], (int(f[11]) + int(f[12])) / tick)
        stack += children(pid)
    return out


def cpu_cores(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float) -> dict:
    """CPU cores used between two `cpu_seconds` by the engine-core process, the API workers (total, busiest,
    least busy: how evenly the connections spread) and the rest of the tree."""
    used = {pid: (comm, (t - before[pid][1]) / seconds) for pid, (comm, t) in after.items() if pid in before}
    workers = sorted(c for comm, c in used.values() if comm.startswith("csmserve-api"))
    return {"engine": round(sum(c for comm, c in used.values() if comm == "csmserve-engine"), 2),
            "workers": round(sum(workers), 2), "workers_n": len(workers),
            "worker_max": round(workers[-1], 2) if workers else None,
            "worker_min": round(workers[0], 2) if workers else None,
            "other": round(sum(c for comm, c in used.values()
                               if comm != "csmserve-engine" and not comm.startswith("csmserve-api")), 2)}
