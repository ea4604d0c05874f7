"""Per-request timelines (EngineConfig.trace_requests, `csmserve serve --trace-requests DIR`): opt-in.

Each process of the server (the engine core, every API worker; the one process with --api-workers 0)
starts one `Tracer` and appends JSON lines to its own file DIR/<role>-<pid>.jsonl. Stamps are
time.perf_counter() (CLOCK_MONOTONIC on Linux: comparable between the processes of one host). Off,
`current()` is None and every call site is one `is not None` test.

Lines (`k` names the kind):
  meta     role, pid, client (a worker's client id), the perf_counter / wall clock pair at start
  req      a request's stamps, one dict: the engine's (id, handle, drained, dstep: the step the drain
           fed, admitted, astep, fstep: the step that ran its first frame) or the worker's (id,
           received, build0, build1: the builder done in its thread, built, sent, chunk: the first
           chunk with audio out of the engine client, written: its bytes handed to the response)
  <table>  {"k": table, "cols": [...], "rows": [[...], ...]}: what was recorded since the last flush
           gc       t0, t1, gen                    every GC pause of the process (gc.callbacks)
           step     the engine's launches: step, t_iter (iteration start), t_awake (after the pacer's
                    sleep), t_drained, t_sched (schedule() began), t_launched (runner.step returned),
                    rows (frame-step rows), admits, prefill (prompt positions), drained (messages),
                    reader_wait (s waited in _await_readers)
           collect  the engine's reads of a step: step, t_wait (began waiting), t_done (results on
                    the host), t_emitted (its EngineSteps sent), rows (live rows)
           emit     the engine's EngineSteps: step, client, t (built, handed to the client's connection)
           recv     a worker's EngineSteps: step, t_recv (read off the connection), t_deliver (the
                    Router ran it on the event loop), rows
           flush    t0, t1, lines: this file's own writes

Records go into a deque (append and popleft are atomic: the GC callback, the worker's reader
thread and its event loop all append); flush() writes them out, inline in the engine loop after a
step's results are sent, on a helper thread in a worker. Only rows that start a request touch Python.
"""
from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections import deque
from pathlib import Path

TABLES = {
    "gc": ("t0", "t1", "gen"),
    "step": ("step", "t_iter", "t_awake", "t_drained", "t_sched", "t_launched", "rows", "admits", "prefill",
             "drained", "reader_wait"),
    "collect": ("step", "t_wait", "t_done", "t_emitted", "rows"),
    "emit": ("step", "client", "t"),
    "recv": ("step", "t_recv", "t_deliver", "rows"),
    "flush": ("t0", "t1", "lines"),
}
FLUSH_S = 0.5

_tracer: Tracer | None = None


def current() -> Tracer | None:
    """This process's tracer, or None (tracing off)."""
    return _tracer


def start(directory: str, role: str, **meta) -> Tracer:
    """This process's tracer (one per process: a second start() returns the first, e.g. the engine on a
    thread of the API's process)."""
    global _tracer
    if _tracer is None:
        _tracer = Tracer(directory, role, **meta)
    return _tracer


class Tracer:
    def __init__(self, directory: str, role: str, **meta) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{role}-{os.getpid()}.jsonl"
        self.records: deque = deque()  # (table, row tuple) | ("req", dict)
        self.pending: dict[str, dict] = {}  # a worker's requests before done(), by id
        self._file = open(self.path, "a", buffering=1 << 16)
        self._next_flush = time.perf_counter() + FLUSH_S
        self._gc_t0 = 0.0
        self._closed = False
        self._lock = threading.Lock()  # flush() from the loop and from atexit / close
        self._write([json.dumps({"k": "meta", "role": role, "pid": os.getpid(), "t": time.perf_counter(),
                                 "wall": time.time(), **meta})])
        gc.callbacks.append(self._gc)

    # ---- recording (any thread)
    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.records.append(("gc", (self._gc_t0, time.perf_counter(), info["generation"])))

    def row(self, table: str, *values) -> None:
        self.records.append((table, values))

    def request(self, stamps: dict) -> None:
        self.records.append(("req", stamps))

    # an API worker's request, stamped as it goes (its event loop only): written by done()
    def stamp(self, request_id: str, **stamps: float) -> None:
        rec = self.pending.get(request_id)
        if rec is None:
            rec = self.pending[request_id] = {"id": request_id}
        rec.update(stamps)

    def done(self, request_id: str, **stamps) -> None:
        """The request's record is complete (its first chunk written, or it ended first): written out."""
        rec = self.pending.pop(request_id, None)
        if rec is not None:
            rec.update(stamps)
            self.records.append(("req", rec))

    # ---- writing
    def maybe_flush(self) -> None:
        """flush() at most every FLUSH_S (the engine loop calls it once per iteration)."""
        if time.perf_counter() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._closed:
                return
            t0 = time.perf_counter()
            self._next_flush = t0 + FLUSH_S
            q, n = self.records, len(self.records)
            tables: dict[str, list] = {}
            lines = []
            for _ in range(n):
                kind, rec = q.popleft()
                if kind == "req":
                    lines.append(json.dumps({"k": "req", **rec}))
                else:
                    tables.setdefault(kind, []).append(rec)
            for kind, rows in tables.items():
                lines.append(json.dumps({"k": kind, "cols": TABLES[kind], "rows": rows}))
            self._write(lines)
            if n > 1 or (n == 1 and "flush" not in tables):  # not a flush of the last flush's own row
                self.records.append(("flush", (t0, time.perf_counter(), len(lines))))

    def _write(self, lines: list[str]) -> None:
        if lines:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()

    def run_flusher(self) -> threading.Thread:
        """flush() every FLUSH_S on a daemon thread (an API worker: nothing on its event loop)."""
        def loop() -> None:
            while not self._closed:
                time.sleep(FLUSH_S)
                self.flush()

        t = threading.Thread(target=loop, name="csmserve-trace", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        try:
            gc.callbacks.remove(self._gc)
        except ValueError:
            pass
        self.flush()
        with self._lock:
            self._closed = True
            self._file.close()
