"""`csmserve serve` as processes: the engine core alone, N API workers, and the parent watching them.

    parent (serve_processes): binds the listening socket, starts the engine-core process (EngineProcess:
      engine/core.py; it exits if the parent is killed) and N API workers, hands each accepted connection
      to the worker with the fewest open ones (server/dispatch.py), restarts a worker that dies, stops
      everything on SIGINT / SIGTERM.
    worker i: create_app(...) over CSM.attach(RemoteEngineClient(...)): prompts are built in the worker,
      requests go to the engine as messages, each engine step comes back as one (PCM in a shared-memory ring).

Shared by the workers: the voice store, the sessions (a SQLite file in the run directory, so a context_id
continues on any worker), metrics (prometheus multiprocess mode) and the config. If the engine process dies,
every worker answers /health and /ready 503 `engine_failed`; if it hangs (silent for --engine-stall-s), 503
`engine_stalled` until it sends again. A worker the engine dropped (frozen until its connection stayed full for
--reader-wait-s: engine/core.py) exits once it runs again, and is started again as a dead one is. A Ray replica
(ray/replica.py) runs this same unit, a Supervisor, and polls it (`check`) where `csmserve serve`'s parent loops over
it (`watch`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from csmserve.config import EngineConfig, ServerConfig

log = logging.getLogger("csmserve.server")


def default_api_workers(cores: int | None = None) -> int:
    """Every core but the engine's and two more (1,024 mp3 streams took 7 workers at 100% of 16 cores), 1 to 32.
    cores: the unit's share of the machine (a Ray replica's); None: all of it."""
    return max(1, min(32, (cores if cores is not None else os.cpu_count() or 2) - 3))


@dataclass(frozen=True)
class ServeSpec:
    """One `csmserve serve` unit: the model, its configs, its share of a GPU, a Ray replica's name."""

    model: str = "sesame/csm-1b"
    device: str | None = None
    dtype: str | None = None
    codec: str | None = None
    codec_dtype: str | None = None
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    log_level: str = "info"
    gpu_share: float = 1.0  # the fraction of a GPU the engine has: sizes its slots when max_slots is None
    replica: str | None = None  # every response's `x-csmserve-replica` (a Ray replica's id)
    # `--lora NAME=PATH`: adapters served from the start (paths on the engine's machine)
    adapters: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_args(cls, args, server: ServerConfig, engine: EngineConfig, **kw) -> ServeSpec:
        from csmserve.server.flags import lora_adapters

        kw.setdefault("adapters", tuple(lora_adapters(args).items()))
        return cls(args.model, args.device, args.dtype, args.codec, getattr(args, "codec_dtype", None), server,
                   engine, args.log_level, **kw)


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    client_id: int  # the engine's name for this worker (unique per start)
    server: ServerConfig
    address: str
    authkey: bytes
    sessions_db: str
    log_level: str
    parent_pid: int | None = None  # the worker exits once this process is gone (it would hold the port)
    replica: str | None = None  # ServeSpec.replica


def run_worker(spec: WorkerSpec, link: socket.socket, counters) -> None:
    """An API worker's main: the app over the connections the parent sends on `link`, attached to the engine."""
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.index}]: %(message)s")
    from csmserve.engine.core import exit_with_parent, freeze_gc
    from csmserve.server.app import create_app
    from csmserve.server.dispatch import DispatchedServer
    from csmserve.server.timeouts import uvicorn_config

    exit_with_parent(spec.parent_pid, what=f"API worker {spec.index}")

    def load():  # waits for the engine (it may still be loading the model and capturing graphs)
        return attach_engine(spec.address, spec.authkey, spec.client_id, on_dropped=_exit_dropped)

    # worker 0 answers at once (/health 200, /ready and the routes 503 while the engine loads); the others
    # accept connections only once attached, so no request lands on a worker still connecting
    kw = dict(sessions_path=spec.sessions_db, worker=spec.index, replica=spec.replica)
    app = create_app(None, spec.server, load=load, **kw) if spec.index == 0 else create_app(load(), spec.server, **kw)
    config = uvicorn_config(app, spec.server, log_level=spec.log_level.lower(), ws="websockets-sansio")
    freeze_gc()  # torch and the app imported: a full collection no longer walks them
    state = app.state.server
    state.workers = (counters, spec.index)  # --max-concurrent-requests counts every worker's generations
    DispatchedServer(config, link, counters, spec.index, attached=lambda: state.ready).run()


def attach_engine(address: str, authkey: bytes, client_id: int, timeout: float = 24 * 3600, on_dropped=None):
    """An API side's CSM over an engine-core process (waits up to `timeout` for the engine to listen); on_dropped:
    RemoteEngineClient's."""
    from csmserve.api import CSM
    from csmserve.engine.remote import RemoteEngineClient

    return CSM.attach(RemoteEngineClient(address, authkey, client_id, timeout=timeout, on_dropped=on_dropped))


DROPPED_EXIT = 3  # a worker the engine dropped: its exit code (the parent starts it again)


def _exit_dropped() -> None:
    """A worker the engine dropped cannot attach again under its client id (its requests were aborted, its ring
    reads forgotten): it exits and its parent starts a fresh one. Its streams were just ended with an error: a
    moment for the event loop to send those errors out first."""
    time.sleep(0.5)
    os._exit(DROPPED_EXIT)


# slots' share of what a GPU share leaves after the weights and the prefix cache. At 0.85 (a whole GPU's) a
# half-H100 engine sized 1,500 slots and held 41.1 of its 39.6 GiB: the graphs, workspaces and CUDA context took
# ~6.7 GiB beside 29.2 GiB of slots, and its neighbour ran out of memory (1ef1ee3). 0.75: ~1,320 slots, ~37.7 GiB.
SHARE_MEMORY_FRACTION = 0.75


def load_engine_model(spec, gpu_share: float = 1.0, adapters: tuple[tuple[str, str], ...] = ()):
    """The engine-core process's model (CSM without an engine of its own). gpu_share < 1: the prefix cache is
    its fixed default (a whole GPU's engine takes half of the device's free memory, which here is a neighbour's
    share too), and with no max_slots the slots are sized to the share (slots_in_share). adapters: `--lora`'s
    (name, path) pairs, checked here (a bad one fails the start) and served from the engine's first step."""
    from csmserve.api import CSM
    from csmserve.engine.prefix_cache import default_prefix_cache_bytes

    csm = CSM(spec.model, device=spec.device, dtype=spec.dtype, codec=spec.codec, codec_dtype=spec.codec_dtype,
              engine_config=spec.engine, **({"adapters": dict(adapters)} if adapters else {}))
    if csm.device.type == "cuda" and gpu_share < 1:
        engine = spec.engine
        if engine.prefix_cache_bytes is None:
            engine = dataclasses.replace(engine, prefix_cache_bytes=default_prefix_cache_bytes("cuda"))
        if engine.max_slots is None:
            engine = dataclasses.replace(engine, max_slots=slots_in_share(csm, engine, gpu_share))
        csm.engine_config = engine
    return csm


def slots_in_share(csm, engine: EngineConfig, gpu_share: float) -> int:
    """Slots that fit in share x the GPU's memory, less what this process holds (run where the weights are) and
    the prefix cache (engine.prefix_cache_bytes, set)."""
    import torch

    from csmserve.engine.slots import size_slots

    total = torch.cuda.mem_get_info(csm.device)[1]
    free = int(total * gpu_share) - torch.cuda.memory_allocated(csm.device)
    return size_slots(csm.model, csm.mimi, engine.max_seq_len, reserve_bytes=engine.prefix_cache_bytes,
                      free_bytes=max(0, free), memory_fraction=SHARE_MEMORY_FRACTION)


def new_rundir() -> Path:
    """A run directory tmp/csmserve-PID-* (sweep_stale removes it once PID is gone), after sweeping."""
    sweep_stale(Path("/dev/shm"), Path(tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"csmserve-{os.getpid()}-"))


def engine_spec(model: str, device: str | None, dtype: str | None, codec: str | None, codec_dtype: str | None,
                engine: EngineConfig, log_level: str, rundir: Path):
    """An engine-core process's spec: its ring file /dev/shm/csmserve-PID-*, socket rundir/engine.sock, a fresh
    authkey; the engine exits when this process is gone."""
    from csmserve.engine.core import EngineSpec

    shm = Path("/dev/shm")
    ring = str((shm if shm.is_dir() else rundir) / f"csmserve-{os.getpid()}-{secrets.token_hex(4)}")
    return EngineSpec(model, device, dtype, codec, codec_dtype, engine, str(rundir / "engine.sock"),
                      secrets.token_bytes(16), ring, log_level, parent_pid=os.getpid())


class EngineProcess:
    """One engine-core process (engine/core.py serve_engine). Its word on the ready pipe: ("ready", EngineInfo)
    or ("error", why); stop() ends it and removes its ring file and socket."""

    def __init__(self, spec, load=load_engine_model, name: str = "csmserve-engine") -> None:
        self.spec, self.load, self.name = spec, load, name
        self.ctx = multiprocessing.get_context("spawn")
        self.process = None
        self._ready_r = None

    def start(self) -> None:
        from csmserve.engine.core import serve_engine

        self._ready_r, ready_w = self.ctx.Pipe(duplex=False)
        self.process = self.ctx.Process(target=run_named, args=(self.name, serve_engine, self.spec, self.load, ready_w),
                                        name=self.name)
        self.process.start()
        ready_w.close()  # the child's end only: its exit reads as EOF here

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode

    def poll(self, timeout: float = 0.0) -> tuple[str, object] | None:
        """The engine's word, if it sent one within `timeout` s."""
        if self._ready_r is None:
            return None
        try:
            return self._ready_r.recv() if self._ready_r.poll(timeout) else None
        except (EOFError, OSError):  # exited: no more words
            self._ready_r.close()
            self._ready_r = None
            return None

    def wait_ready(self, poll_s: float = 0.2):
        """Until the engine listens -> its EngineInfo; RuntimeError if it failed or exited first."""
        while True:
            word = self.poll(poll_s)
            if word is not None:
                kind, what = word
                if kind == "ready":
                    return what
                raise RuntimeError(f"the engine failed to start: {what}")
            if not self.alive:
                raise RuntimeError(f"the engine process exited (code {self.exitcode}) before it was ready")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` s; its ring file and socket removed."""
        p = self.process
        if p is not None:
            if p.is_alive():
                p.terminate()
            p.join(max(0.1, timeout))
            if p.is_alive():
                p.kill()
                p.join(5)
        if self._ready_r is not None:
            self._ready_r.close()
            self._ready_r = None
        for path in (self.spec.ring_path, self.spec.address):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def run_named(name: str, target, *args) -> None:
    """A child's main under its own process name (/proc/PID/comm, 15 bytes: what ps shows and the soak reads)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME (Linux; elsewhere a no-op)
    except (OSError, AttributeError):
        pass
    target(*args)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv6 where the host is); OSError naming the port and the flag if taken."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port") from None
    return s


WORKER_EXITS = 3  # a worker exiting this often within WORKER_EXITS_S: the unit is failing (Supervisor.fatal)
WORKER_EXITS_S = 60.0
WORKER_EXIT_S = 5.0  # past --shutdown-timeout-s, a worker's own end (its lifespan's) before it is killed


class Supervisor:
    """One unit: the listening socket (`port`: the one bound), the engine-core process, API workers, dispatch."""

    def __init__(self, spec: ServeSpec, workers: int) -> None:
        self.spec, self.server, self.workers_n = spec, spec.server, workers
        self.sock = bind(self.server.host, self.server.port)  # first: a taken port leaves no run directory
        self.rundir = new_rundir()
        self.sessions_db = str(self.rundir / "sessions.db")
        metrics = self.rundir / "metrics"
        metrics.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)  # inherited by the workers (spawn)
        self.engine_spec = engine_spec(spec.model, spec.device, spec.dtype, spec.codec, spec.codec_dtype, spec.engine,
                                       spec.log_level, self.rundir)
        self.ctx = multiprocessing.get_context("spawn")
        self.sock.listen(2048)
        self.sock.set_inheritable(True)
        self.port: int = self.sock.getsockname()[1]
        from csmserve.server.dispatch import Dispatcher

        self.dispatcher = Dispatcher(self.sock, workers, self.ctx)
        load = load_engine_model if spec.gpu_share >= 1 and not spec.adapters else functools.partial(
            load_engine_model, gpu_share=spec.gpu_share, adapters=spec.adapters)
        self.engine = EngineProcess(self.engine_spec, load)
        self.workers: list = [None] * workers
        self.engine_ready = False
        self.engine_error: str | None = None  # the engine's word when it failed to start
        self.worker_exits: deque[float] = deque()  # when workers exited, the last WORKER_EXITS_S
        self._next_client = 1
        self._stopping = False
        self._engine_down = False

    def start(self) -> None:
        self.engine.start()
        for i in range(self.workers_n):
            self._start_worker(i)
        self.dispatcher.start()
        log.info("csmserve: engine process (pid %d), %d API workers on http://%s:%d", self.engine.pid,
                 self.workers_n, self.server.host, self.port)

    def _start_worker(self, i: int) -> None:
        spec = WorkerSpec(i, self._next_client, self.server, self.engine_spec.address, self.engine_spec.authkey,
                          self.sessions_db, self.spec.log_level, parent_pid=os.getpid(), replica=self.spec.replica)
        self._next_client += 1
        link = self.dispatcher.new_link(i)  # connections come from the parent's dispatch thread
        args = (f"csmserve-api-{i}", run_worker, spec, link, self.dispatcher.counters)
        p = self.ctx.Process(target=run_named, args=args, name=f"csmserve-worker-{i}")
        p.start()
        link.close()  # the worker has its own copy
        self.workers[i] = p
        log.info("API worker %d started (pid %d)", i, p.pid)

    @property
    def worker_pids(self) -> list[int | None]:
        return [None if p is None else p.pid for p in self.workers]

    def check(self) -> None:
        """One look at the processes: the engine's word, the engine gone, a worker gone (started again)."""
        word = self.engine.poll()
        if word is not None:
            kind, what = word
            (log.info if kind == "ready" else log.error)("engine %s: %s", kind, what)
            self.engine_ready = kind == "ready"
            self.engine_error = None if kind == "ready" else str(what)
        if not self._engine_down and not self.engine.alive:
            self._engine_down = True
            log.critical("the engine process exited (code %s): the workers answer 503 engine_failed; "
                         "restart the server", self.engine.exitcode)
        now = time.monotonic()
        while self.worker_exits and self.worker_exits[0] < now - WORKER_EXITS_S:
            self.worker_exits.popleft()
        for i, p in enumerate(self.workers):
            if p is not None and not p.is_alive() and not self._stopping:
                self.worker_exits.append(now)
                _mark_dead(p.pid)
                if self._engine_down:  # a new worker could not attach (and would answer 200 while it tried)
                    log.error("API worker %d exited (code %s); the engine is gone: not started again", i, p.exitcode)
                    self.workers[i] = None
                    continue
                log.error("API worker %d exited (code %s); starting it again", i, p.exitcode)
                self._start_worker(i)

    def fatal(self) -> str | None:
        """Why this unit cannot serve (None: it can, or is still starting)."""
        if self.engine_error is not None:
            return f"the engine failed to start: {self.engine_error}"
        if self.engine.process is not None and not self.engine.alive:
            return f"the engine process (pid {self.engine.pid}) exited (code {self.engine.exitcode})"
        if len(self.worker_exits) >= WORKER_EXITS:
            return f"API workers exited {len(self.worker_exits)} times in {WORKER_EXITS_S:.0f} s"
        return None

    def watch(self) -> int:
        """`csmserve serve`'s parent, until stopped. RuntimeError (the command's one line, a non-zero exit for the
        orchestrator to act on) where the unit cannot serve and nothing would say so: the engine failed to start or
        died before it was ready, API workers keep exiting (WORKER_EXITS in WORKER_EXITS_S), or the engine is gone
        and no worker is left to answer 503 engine_failed. An engine that dies while serving leaves the workers
        answering 503 engine_failed (docs/reliability.md)."""
        while not self._stopping:
            time.sleep(0.2)
            self.check()
            if self.engine_error is not None:
                raise RuntimeError(f"the engine failed to start: {' '.join(self.engine_error.split())}")
            if self._engine_down and not self.engine_ready:
                raise RuntimeError(f"the engine process exited (code {self.engine.exitcode}) before it was ready")
            if len(self.worker_exits) >= WORKER_EXITS:
                raise RuntimeError(f"API workers exited {len(self.worker_exits)} times in {WORKER_EXITS_S:.0f} s")
            if self._engine_down and not any(p is not None and p.is_alive() for p in self.workers):
                raise RuntimeError(f"the engine process exited (code {self.engine.exitcode}) and no API worker is "
                                   "left")
        return 0

    def stop(self, *_: object) -> None:
        self._stopping = True

    def shutdown(self) -> None:
        self._stopping = True
        self.dispatcher.stop()
        workers = [p for p in self.workers if p is not None]
        # the workers first (their streams end, or are cut at --shutdown-timeout-s; then their lifespan's end),
        # then the engine: a worker outliving the engine would report it lost
        deadline = time.monotonic() + self.spec.server.shutdown_timeout_s + WORKER_EXIT_S
        for p in workers:
            if p.is_alive():
                p.terminate()
        for p in workers:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        self.engine.stop(max(WORKER_EXIT_S, deadline - time.monotonic()))  # and its ring file, its socket
        self.sock.close()
        shutil.rmtree(self.rundir, ignore_errors=True)


_STALE = re.compile(r"csmserve-(\d+)-[^/]+")  # the ring (/dev/shm) and run directory (tmp) of the server of pid


def sweep_stale(*dirs: Path) -> list[Path]:
    """Remove what servers killed with SIGKILL left (the ring's shared-memory file, hundreds of MB of RAM, and
    the run directory), named after a parent pid that no longer runs."""
    removed = []
    for d in dirs:
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        for path in entries:
            m = _STALE.fullmatch(path.name)
            if m is None or _pid_alive(int(m.group(1))):
                continue
            try:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                removed.append(path)
            except OSError:
                pass
    if removed:
        log.info("removed what killed servers left: %s", ", ".join(map(str, removed)))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def _mark_dead(pid: int) -> None:
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
    except Exception:  # noqa: BLE001 - metrics bookkeeping only
        pass


def serve_processes(args, server: ServerConfig, engine: EngineConfig) -> int:
    workers = server.api_workers if server.api_workers is not None else default_api_workers()
    server = dataclasses.replace(server, api_workers=workers)
    sup = Supervisor(ServeSpec.from_args(args, server, engine), workers)
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    try:
        sup.start()
        return sup.watch()
    finally:
        sup.shutdown()
