"""server/dispatch.py's Dispatcher without uvicorn: stand-in workers on threads take the fds it sends.

Connections that stay open spread evenly; a worker not ready gets none; a worker whose link is gone
(its process died) is skipped, and the connection goes to another; one whose send fails for a moment is
skipped for that connection only; a restarted worker starts from zero.
"""
from __future__ import annotations

import errno
import socket
import threading
import time

import pytest

from csmserve.server.dispatch import _OPEN, _READY, _RECEIVED, ATTACHED, SERVING, Dispatcher


class FakeWorker:
    """Takes connections from its link and keeps them open; reports like a real worker (open, received)."""

    def __init__(self, d: Dispatcher, i: int, ready: bool = True, extra_open: int = 0, level: int = ATTACHED) -> None:
        self.d, self.i, self.link = d, i, d.new_link(i)
        self.extra_open = extra_open  # reported on top of its own (a worker that looks busy)
        self.socks: list[socket.socket] = []
        self.link.settimeout(0.05)
        self.stop = False
        if ready:
            d.counters.set(i, _READY, level)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                msg, fds, _, _ = socket.recv_fds(self.link, 1, 4)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            if not msg:
                return
            self.socks += [socket.socket(fileno=fd) for fd in fds]
            self.d.counters.set(self.i, _RECEIVED, len(self.socks))
            self.d.counters.set(self.i, _OPEN, self.extra_open + sum(s.fileno() >= 0 for s in self.socks))

    def close_all(self) -> None:
        for s in self.socks:
            s.close()
        self.d.counters.set(self.i, _OPEN, 0)


class Rig:
    """A Dispatcher on a listening socket of its own, and the client connections made to it."""

    def __init__(self, workers: int) -> None:
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.d = Dispatcher(self.lsock, workers)
        self.clients: list[socket.socket] = []

    def connect(self, n: int) -> None:
        self.clients += [socket.create_connection(self.lsock.getsockname()[:2]) for _ in range(n)]

    def close(self) -> None:
        self.d.stop()
        for c in self.clients:
            c.close()
        self.lsock.close()


@pytest.fixture
def rig():
    """rig(workers) -> a Rig; every one stopped at teardown, whether the test passed or not."""
    rigs: list[Rig] = []

    def make(workers: int) -> Rig:
        rigs.append(Rig(workers))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_open_connections_spread_evenly_and_not_to_workers_not_ready(rig):
    r = rig(4)
    workers = [FakeWorker(r.d, i, ready=i != 3) for i in range(4)]
    r.d.start()
    r.connect(9)
    assert _wait(lambda: sum(len(w.socks) for w in workers) == 9)
    assert [len(w.socks) for w in workers] == [3, 3, 3, 0]
    # worker 1 loses its connections: the next three go there
    workers[1].close_all()
    r.connect(3)
    assert _wait(lambda: sum(len(w.socks) for w in workers) == 12)
    assert [len(w.socks) for w in workers] == [3, 6, 3, 0]


def test_a_worker_gone_is_skipped_and_a_restarted_one_starts_from_zero(rig):
    r = rig(2)
    workers = [FakeWorker(r.d, 0), FakeWorker(r.d, 1)]
    r.d.start()
    r.connect(4)
    assert _wait(lambda: [len(w.socks) for w in workers] == [2, 2])
    workers[0].stop = True
    workers[0].t.join()
    workers[0].link.close()  # its process died: the parent's send fails
    r.connect(3)
    assert _wait(lambda: len(workers[1].socks) == 5)
    assert r.d.counters.get(0, _READY) == 0
    # worker 0 again (a fresh process: a fresh link, counters from zero): it gets the next ones
    workers[0] = FakeWorker(r.d, 0)
    assert r.d.load(0) == 0
    r.connect(2)
    assert _wait(lambda: len(workers[0].socks) == 2)


def test_a_worker_that_stops_reading_its_link_is_passed_over(rig):
    r = rig(2)
    stalled = FakeWorker(r.d, 0)
    stalled.stop = True  # its process hangs: the link is never read again
    stalled.t.join()
    live = FakeWorker(r.d, 1, extra_open=10**6)  # looks far busier: the stalled one stays the least loaded
    r.d.counters.set(1, _OPEN, 10**6)
    r.d.start()
    n = 0
    while n < 2000 and len(live.socks) < 50:  # far more than a link's buffer holds
        r.connect(10)
        n += 10
        assert _wait(lambda: sum(r.d.sent) >= n, timeout=10), (n, r.d.sent)
    assert len(live.socks) >= 50 and r.d.sent[0] > 50  # the stalled one got what its link holds, then no more


@pytest.mark.parametrize("error, gone", [
    (OSError(errno.ETOOMANYREFS, "Too many references"), False),  # more fds in flight than RLIMIT_NOFILE (not root)
    (OSError(errno.ENOBUFS, "No buffer space available"), False),  # the kernel short of memory for a moment
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), True),
], ids=["ETOOMANYREFS", "ENOBUFS", "ECONNRESET"])
def test_a_send_that_fails_for_a_moment_skips_the_worker_for_that_connection_only(rig, monkeypatch, error, gone):
    """send_fds failing once for a worker alive (ETOOMANYREFS: the parent's fds in flight over all links past its
    RLIMIT_NOFILE, under a burst of connections): that connection goes to the other worker and the next ones to
    both again. It set the worker not ready for good (only its restart sets it back). A dead link still does."""
    r = rig(2)
    workers = [FakeWorker(r.d, 0), FakeWorker(r.d, 1)]
    send, failed = socket.send_fds, []

    def send_once_failing(sock, *a):
        if not failed:
            failed.append(r.d.links.index(sock))
            raise error
        return send(sock, *a)

    monkeypatch.setattr(socket, "send_fds", send_once_failing)
    r.d.start()
    r.connect(1)
    assert _wait(lambda: sum(len(w.socks) for w in workers) == 1)
    i = failed[0]
    assert len(workers[1 - i].socks) == 1
    assert r.d.counters.get(i, _READY) == (0 if gone else ATTACHED)
    r.connect(5)
    assert _wait(lambda: sum(len(w.socks) for w in workers) == 6)
    assert len(workers[i].socks) == (0 if gone else 3)


def test_connections_go_to_attached_workers_while_any_is_and_to_a_serving_one_otherwise(rig):
    r = rig(3)  # worker 0 serves while its engine link attaches (/health 200, the routes 503 model_not_ready)
    workers = [FakeWorker(r.d, 0, level=SERVING), FakeWorker(r.d, 1), FakeWorker(r.d, 2)]
    r.d.start()
    r.connect(6)
    assert _wait(lambda: sum(len(w.socks) for w in workers) == 6)
    assert [len(w.socks) for w in workers] == [0, 3, 3]  # a client told /ready 200 never lands on worker 0
    r.d.counters.set(0, _READY, ATTACHED)  # attached now: it catches up
    r.connect(6)
    assert _wait(lambda: sum(len(w.socks) for w in workers) == 12)
    assert [len(w.socks) for w in workers] == [4, 4, 4]
    alone = rig(1)
    only = FakeWorker(alone.d, 0, level=SERVING)
    alone.d.start()
    alone.connect(2)  # no worker attached yet: the serving one answers (its /health, /ready 503)
    assert _wait(lambda: len(only.socks) == 2)


def test_generations_are_counted_for_all_workers_together():
    from csmserve.server.dispatch import Counters

    c = Counters(3)
    assert c.admit(0, 2) and c.admit(2, 2)
    assert not c.admit(1, 2) and not c.admit(0, 2)  # two in flight: the limit, whichever worker asks
    c.release(2)
    assert c.admit(1, 2) and not c.admit(2, 2)
    c.reset(1)  # worker 1 restarted: its generations ended with it
    assert c.admit(2, 2) and not c.admit(0, 2)
    c.lock.acquire()  # a worker killed while it held the lock: the restart's reset frees it
    c.reset(0)
    assert c.lock.acquire(timeout=0.1)
    c.lock.release()


def test_a_connection_no_worker_takes_in_time_is_answered_503(rig, monkeypatch):
    """No worker ready for READY_WAIT_S (all starting, or stalled): the client gets a 503 server_busy in OpenAI's
    shape, not a connection closed without a word."""
    import json

    from csmserve.server import dispatch

    monkeypatch.setattr(dispatch, "READY_WAIT_S", 0.3)
    r = rig(1)
    FakeWorker(r.d, 0, ready=False)
    r.d.start()
    r.connect(1)
    c = r.clients[0]
    c.settimeout(5)
    data = b""
    while chunk := c.recv(4096):
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "server_busy"
