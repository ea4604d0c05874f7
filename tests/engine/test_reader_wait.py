"""A worker that reads the output ring late slows the engine down instead of losing its streams (the
ring's acks, engine.py `_await_readers`); one that never reads is given up on after reader_wait_s; one
that left is never waited for. CPU, dummy-tiny, a 3-buffer ring in a shared-memory file."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from csmserve.config import EngineConfig
from csmserve.engine.engine import build_engine
from csmserve.engine.output_ring import OutputRing
from csmserve.engine.outputs import CLIENT_SHIFT
from csmserve.engine.request import Request
from csmserve.models.loader import load_csm
from csmserve.sampling import SamplingParams

from test_engine import prompt  # same folder

RING = 3
CLIENT = 5
SLOW = 0.25  # s a slow worker takes per step (a dummy-tiny step on the CPU: ~10-60 ms)


@pytest.fixture(scope="module")
def model():
    return load_csm("dummy-tiny")[0]


class Worker:
    """What RemoteEngineClient does with each EngineStep: copy its rows from the ring, check the header
    still names the step (else the rows were lost), then ack the step in the ring file."""

    def __init__(self, ring_spec: dict, client: int, delay_s: float = 0.0) -> None:
        self.ring = OutputRing.attach(ring_spec)
        self.client, self.delay_s = client, delay_s
        self.inbox: list = []
        self.read = self.lost = 0
        self.cv = threading.Condition()
        self.stop = False

    def emit(self, client: int, step, out) -> None:
        if client == self.client and len(step.rows):
            with self.cv:
                self.inbox.append(step)
                self.cv.notify()

    def run(self) -> None:
        while True:
            with self.cv:
                while not self.inbox and not self.stop:
                    self.cv.wait()
                if not self.inbox:
                    return
                step = self.inbox.pop(0)
            time.sleep(self.delay_s)  # a busy process
            self.ring["codes"][step.ring][step.rows].copy()
            if self.ring["header"][step.ring] == step.step:
                self.read += 1
            else:
                self.lost += 1
            self.ring["acks"][self.client] = step.step


def engine_with(model, tmp_path, worker_delay: float | None, wait_s: float):
    cfg = EngineConfig(max_slots=2, max_seq_len=256, prefill_token_budget=16, reader_wait_s=wait_s)
    holder: dict = {}
    engine = build_engine(model, None, cfg, start=False, ring_path=str(tmp_path / "ring"), ring_slots=RING,
                          emit=lambda c, step, out: holder["w"].emit(c, step, out))
    worker = Worker(engine.runner.ring.spec(), CLIENT, worker_delay or 0.0)
    holder["w"] = worker
    thread = None
    if worker_delay is not None:
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
    req = Request(*prompt(4, 0), params=SamplingParams(temperature=0.0, max_audio_length_ms=80 * 400))
    req.handle = CLIENT << CLIENT_SHIFT | 1
    engine.submit(req)
    return engine, worker, thread


def steps(engine, n: int) -> None:
    for _ in range(n):
        engine.step()


def finish(worker, thread) -> None:
    with worker.cv:
        worker.stop = True
        worker.cv.notify()
    if thread is not None:
        thread.join(10)


def test_a_slow_reader_is_waited_for_and_loses_nothing(model, tmp_path):
    engine, worker, thread = engine_with(model, tmp_path, worker_delay=SLOW, wait_s=30.0)
    steps(engine, 4 * RING)  # the reader far slower than the steps: without the wait most would be overwritten
    finish(worker, thread)
    assert worker.lost == 0
    assert worker.read >= 4 * RING - 2
    assert engine.stats["reader_waits"] > 0


def test_without_waiting_a_slow_reader_loses_rows(model, tmp_path):
    """The same reader with reader_wait_s 0: what the wait prevents (the test above would fail so)."""
    engine, worker, thread = engine_with(model, tmp_path, worker_delay=SLOW, wait_s=0.0)
    steps(engine, 4 * RING)
    finish(worker, thread)
    assert worker.lost > 0


def test_a_reader_that_never_reads_is_given_up_on_then_waited_for_again(model, tmp_path):
    engine, worker, _ = engine_with(model, tmp_path, worker_delay=None, wait_s=0.2)
    steps(engine, 3 * RING + 4)
    assert engine.stats["reader_waits"] == 1  # once: then given up, not waited for at every step
    assert 0.2 <= engine.stats["reader_wait_s"]
    assert CLIENT in engine._given_up
    latest = max(s.step for s in worker.inbox)
    worker.ring["acks"][CLIENT] = latest  # it caught up
    steps(engine, 1)
    assert CLIENT not in engine._given_up
    steps(engine, RING)  # and its next reads are waited for again
    assert engine.stats["reader_waits"] == 2


def test_a_client_that_left_is_never_waited_for(model, tmp_path):
    engine, worker, _ = engine_with(model, tmp_path, worker_delay=None, wait_s=30.0)
    steps(engine, 2)
    engine.abort_client(CLIENT)
    t = time.monotonic()
    steps(engine, 3 * RING)
    assert engine.stats["reader_waits"] == 0
    assert time.monotonic() - t < 25  # not one 30 s wait


def test_the_ring_file_holds_acks_a_worker_may_write_and_buffers_it_may_not(tmp_path):
    ring = OutputRing(RING, 2, 4, 8, path=str(tmp_path / "ring"))
    views = OutputRing.attach(ring.spec())
    views["acks"][CLIENT] = 7
    assert ring.caught_up(CLIENT, 7) and not ring.caught_up(CLIENT, 8)
    for name in ("header", "codes", "pcm"):
        with pytest.raises(ValueError):
            views[name][0] = 1
    ring.header[1] = 3
    assert views["header"][1] == 3
    np.testing.assert_array_equal(views["acks"][:CLIENT], -1)


def test_a_worker_shutting_down_under_its_reader_is_not_an_engine_failure(caplog):
    """shutdown() closes the connection while the reader thread may be inside recv_bytes: multiprocessing then
    raises TypeError (its handle is None), not EOFError. That is our own close: no "reading from the engine failed",
    no fatal state; the same error while running is a lost engine."""
    from csmserve.engine.remote import RemoteEngineClient

    class Conn:
        def recv_bytes(self):
            time.sleep(0.05)
            raise TypeError("'NoneType' object cannot be interpreted as an integer")

        def close(self):
            pass

    class Router:
        failed = None

        def fail_all(self, e):
            Router.failed = e

    def reader(closing: bool) -> RemoteEngineClient:
        c = object.__new__(RemoteEngineClient)
        c.conn, c.router, c.loop, c._calls, c._fatal, c._closing = Conn(), Router(), None, {}, None, False
        if closing:
            c.shutdown()
        c._read()
        return c

    with caplog.at_level("ERROR"):
        c = reader(closing=True)
    assert c._fatal is None and Router.failed is None and "reading from the engine failed" not in caplog.text
    c = reader(closing=False)
    assert "reading from the engine failed" in c._fatal and Router.failed is not None
