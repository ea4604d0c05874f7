"""server/processes.py's Supervisor with its child processes stubbed (no torch, no server): when `csmserve serve`'s
parent gives up with one line (an engine that died before it was ready, workers that keep exiting, an engine gone
with no worker left to say so), and a taken port leaves no run directory."""
import itertools
import shutil
import socket
import threading

import pytest

from csmserve.config import EngineConfig, ServerConfig
from csmserve.server import processes


class FakeProc:
    """A multiprocessing.Process stand-in: exits (not alive) as soon as started, or stays alive."""
    pids = itertools.count(4_000_000)

    def __init__(self, *a, dies=True, **k):
        self.dies, self.pid, self.exitcode = dies, next(self.pids), None

    def start(self):
        self.exitcode = 1 if self.dies else None

    def is_alive(self):
        return not self.dies

    def terminate(self):
        pass

    kill = terminate

    def join(self, t=None):
        pass


class FakeEngine:
    def __init__(self, alive=True):
        self._alive, self.pid, self.process = alive, 1, object()

    def start(self):
        pass

    def poll(self, timeout=0.0):
        return None  # no word: e.g. SIGKILLed (OOM) while loading the model

    @property
    def alive(self):
        return self._alive

    exitcode = property(lambda self: None if self._alive else -9)

    def stop(self, timeout=0):
        pass


@pytest.fixture
def sup(monkeypatch, tmp_path):
    monkeypatch.setattr(processes, "sweep_stale", lambda *d: [])  # leave the machine's other servers alone
    monkeypatch.setattr(processes.tempfile, "tempdir", str(tmp_path))
    # the Supervisor points this process's Prometheus at its run directory: put back after (later in-process
    # servers' /metrics would read a directory gone)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    spec = processes.ServeSpec(model="dummy-tiny", device="cpu",
                               server=ServerConfig(host="127.0.0.1", port=0), engine=EngineConfig())
    made = []

    def make(workers):
        s = processes.Supervisor(spec, workers)
        made.append(s)
        return s
    yield make
    for s in made:
        s.dispatcher.stop()
        s.sock.close()
        shutil.rmtree(s.rundir, ignore_errors=True)


def _watch(s, seconds):
    out = {}

    def run():
        try:
            out["rc"] = s.watch()
        except BaseException as e:  # noqa: BLE001
            out["exc"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    still = t.is_alive()
    s.stop()
    t.join(2)
    return still, out


def test_an_engine_dead_before_it_was_ready_ends_the_server(sup):
    """Killed while loading (the OOM killer, a segfault: no word on its pipe): watch() ends with one line, as for an
    engine that failed to start (it served /health 200 and /ready 503 model_not_ready for good)."""
    s = sup(0)
    s.engine = FakeEngine(alive=False)
    still, out = _watch(s, 2.0)
    assert not still and "before it was ready" in str(out.get("exc")), out


def test_a_worker_that_keeps_exiting_ends_the_server(sup, monkeypatch):
    """A worker that dies at once was started again on every 0.2 s check, forever: WORKER_EXITS in WORKER_EXITS_S
    end watch() with one line."""
    s = sup(1)
    s.engine = FakeEngine(alive=True)
    monkeypatch.setattr(s.ctx, "Process", lambda *a, **k: FakeProc(dies=True))
    s.start()
    starts0 = s._next_client
    still, out = _watch(s, 3.0)
    restarts = s._next_client - starts0
    assert restarts <= 3 and not still and "API workers exited" in str(out.get("exc")), (restarts, out)


def test_with_the_engine_gone_a_worker_is_not_started_again(sup, monkeypatch):
    """The engine died while serving: the workers answer 503 engine_failed. One that exits is not started again
    (a new one could not attach, and answered /health 200 while it tried); with none left, watch() ends."""
    s = sup(1)
    s.engine = FakeEngine(alive=True)
    monkeypatch.setattr(s.ctx, "Process", lambda *a, **k: FakeProc(dies=False))
    s.start()
    s.engine_ready = True
    s.engine._alive = False  # the engine dies while serving
    s.check()
    s.workers[0].dies = True  # then the worker
    starts = s._next_client
    still, out = _watch(s, 2.0)
    assert s._next_client == starts and s.workers[0] is None
    assert not still and "no API worker is left" in str(out.get("exc")), out


def test_a_taken_port_leaves_no_run_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.setattr(processes, "sweep_stale", lambda *d: [])
    monkeypatch.setattr(processes.tempfile, "tempdir", str(tmp_path))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    spec = processes.ServeSpec(model="dummy-tiny", device="cpu",
                               server=ServerConfig(host="127.0.0.1", port=port), engine=EngineConfig())
    with pytest.raises(OSError, match="cannot listen"):
        processes.Supervisor(spec, 1)
    assert not list(tmp_path.iterdir())  # the run directory (made after the bind now)
