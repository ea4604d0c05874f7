"""Connection dispatch: the parent accepts, each new connection goes to the API worker with the fewest.

    parent:  Dispatcher(sock, n).start()      accept -> least-loaded ready worker -> its fd over a Unix socket
    worker:  DispatchedServer(config, link)   uvicorn with no listener of its own: serves the sockets it is sent

Why: with one listening socket shared by every worker (docs/tried-and-dropped.md) a keep-alive connection stays
on whichever worker reached accept() first; under 1,024 mp3 users that left the busiest worker saturated (0.99 of
a core) and the least busy at 0.64. Here the parent counts each worker's open connections (sent minus what the
worker reports closed, in `Counters`, every REPORT_S) and sends each new one to the lowest. Ready is SERVING
(worker 0 answers while its engine link attaches: routes 503) or ATTACHED; connections go to attached workers
while any is, so a client told /ready 200 never lands on one still attaching. None ready: the connection waits.
"""
from __future__ import annotations

import array
import asyncio
import logging
import multiprocessing
import signal
import socket
import threading
import time

from csmserve.server.errors import APIError
from csmserve.server.timeouts import raw_response

log = logging.getLogger("csmserve.server")
REPORT_S = 0.02  # how often a worker writes its open-connection count
READY_WAIT_S = 30.0  # a connection waits this long for an API worker to take it (one starting), then 503
LOCK_WAIT_S = 1.0  # the generations' lock is held for microseconds; past this its holder was killed in it
_RECEIVED, _OPEN, _READY, _ACTIVE = 0, 1, 2, 3
_FIELDS = 4
SERVING, ATTACHED = 1, 2  # values of _READY (0: not ready)


class Counters:
    """[n, 4] int64 in shared memory: per worker (received, open, ready, generations in flight); a Process argument
    of the workers. The generations are counted under a lock: --max-concurrent-requests holds for the server, not
    per worker."""

    def __init__(self, n: int, ctx=None) -> None:
        self.n = n
        ctx = ctx or multiprocessing
        self.a = ctx.Array("q", _FIELDS * n, lock=False)
        self.lock = ctx.Lock()

    def get(self, i: int, field: int) -> int:
        return self.a[_FIELDS * i + field]

    def set(self, i: int, field: int, value: int) -> None:
        self.a[_FIELDS * i + field] = value

    def reset(self, i: int) -> None:
        """Before worker i (re)starts: its counts 0 (its generations ended with it). A lock still held after
        LOCK_WAIT_S is the dead worker's (killed inside admit or release): released here."""
        if not self.lock.acquire(timeout=LOCK_WAIT_S):
            self.lock.release()
            self.lock.acquire()
        try:
            for f in (_RECEIVED, _OPEN, _READY, _ACTIVE):
                self.set(i, f, 0)
        finally:
            self.lock.release()

    def admit(self, i: int, limit: int) -> bool:
        """One generation more for worker i, unless the workers' together are at `limit` already."""
        locked = self.lock.acquire(timeout=LOCK_WAIT_S)  # held by a worker killed in it: counted without it
        try:
            if sum(self.a[_FIELDS * j + _ACTIVE] for j in range(self.n)) >= limit:
                return False
            self.a[_FIELDS * i + _ACTIVE] += 1
            return True
        finally:
            if locked:
                self.lock.release()

    def release(self, i: int) -> None:
        locked = self.lock.acquire(timeout=LOCK_WAIT_S)
        self.a[_FIELDS * i + _ACTIVE] -= 1
        if locked:
            self.lock.release()


class Dispatcher:
    """The parent's accept loop on a thread: each connection to the ready worker with the fewest open ones
    (ties in turn), its fd sent over that worker's link (a SOCK_SEQPACKET pair)."""

    def __init__(self, sock: socket.socket, n: int, ctx=None) -> None:
        self.sock, self.n = sock, n
        self.counters = Counters(n, ctx)
        self.sent = [0] * n  # connections sent to each worker (since it was last started)
        self.links: list[socket.socket | None] = [None] * n  # the parent's ends
        self._lock = threading.Lock()
        self._stop = False
        self._turn = -1
        self.thread = threading.Thread(target=self._run, name="csmserve-dispatch", daemon=True)

    def new_link(self, i: int) -> socket.socket:
        """Before (re)starting worker i: a fresh link; returns the worker's end (pass it to the process)."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setblocking(False)  # a worker that stops reading its link is passed over, never waited for
        with self._lock:
            old, self.links[i] = self.links[i], parent
            self.sent[i] = 0
            self.counters.reset(i)
        if old is not None:
            old.close()
        return child

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        except OSError:
            pass

    def load(self, i: int) -> int | None:
        """Worker i's open connections (those sent it has not taken yet included); None: not ready."""
        c = self.counters
        if not c.get(i, _READY) or self.links[i] is None:
            return None
        return c.get(i, _OPEN) + self.sent[i] - c.get(i, _RECEIVED)

    def pick(self, skip: frozenset[int] = frozenset()) -> int | None:
        """Of the most ready workers (attached, else serving), the one with the fewest open connections;
        ties in turn (so one-request connections, opened and closed one after another, still go round)."""
        self._turn = (self._turn + 1) % self.n
        order = [(self._turn + j) % self.n for j in range(self.n)]
        loads = [(-self.counters.get(i, _READY), load, j) for j, i in enumerate(order)
                 if i not in skip and (load := self.load(i)) is not None]
        return order[min(loads)[2]] if loads else None

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._stop:
                    return
                time.sleep(0.01)
                continue
            try:
                self._hand(conn)
            finally:
                conn.close()  # the parent's copy: the worker has its own

    def _hand(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + READY_WAIT_S
        while not self._stop and time.monotonic() < deadline:
            skip: set[int] = set()  # workers this connection could not be sent to now: the next one instead
            with self._lock:
                while (i := self.pick(frozenset(skip))) is not None:
                    try:
                        socket.send_fds(self.links[i], [b"c"], [conn.fileno()])
                        self.sent[i] += 1
                        return
                    except ConnectionError as e:  # EPIPE: the worker is gone, not ready until restarted
                        log.warning("API worker %d did not take a connection (%s)", i, e)
                        self.counters.set(i, _READY, 0)
                    except OSError:
                        # its link full now (EAGAIN: not reading), or the kernel refusing for a moment (ETOOMANYREFS:
                        # the fds in flight over all links past RLIMIT_NOFILE; ENOBUFS): alive, passed over this once
                        skip.add(i)
            time.sleep(0.01)  # no worker ready (starting, or all of them stalled): the client waits
        if self._stop:
            return
        log.error("no API worker ready for %.0f s: a connection was answered 503", READY_WAIT_S)
        try:  # best effort, never blocking the next connections: the request unread, the answer in OpenAI's shape
            conn.setblocking(False)
            conn.send(raw_response(503, "Service Unavailable", APIError(
                503, f"no API worker was ready for {READY_WAIT_S:.0f} s; try again", "server_busy")))
        except OSError:
            pass


class DispatchedServer:
    """A uvicorn.Server that listens on nothing and serves the sockets its link brings, with uvicorn's own
    protocol class (so timeouts, limits, WebSocket upgrades and graceful shutdown behave the same)."""

    def __new__(cls, config, link: socket.socket, counters: Counters, index: int, attached=lambda: True):
        """attached() -> whether the worker's model (its engine link) is up: until then, SERVING only."""
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame) -> None:
                if sig == signal.SIGINT:  # Ctrl-C reaches the whole group: the parent stops this worker (one
                    return  # SIGTERM, a graceful exit); a second signal would make uvicorn cut its streams
                super().handle_exit(sig, frame)

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets=[])  # no listener: the lifespan, the state, nothing bound
                if self.should_exit:
                    return
                _serve_link(self, link, counters, index, attached)

        return _Server(config)


def _serve_link(server, link: socket.socket, counters: Counters, index: int, attached=lambda: True) -> None:
    loop = asyncio.get_running_loop()
    config = server.config
    n = array.array("q", [0, 0])  # received, and received but not yet connected (not in uvicorn's set yet)

    def open_now() -> int:
        return len(server.server_state.connections) + n[1]

    def protocol() -> asyncio.Protocol:
        return config.http_protocol_class(config=config, server_state=server.server_state,
                                          app_state=server.lifespan.state, _loop=loop)

    def readable() -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(link, 1, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:  # the parent is gone (the worker exits with it, engine/core.py)
                loop.remove_reader(link.fileno())
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                n[0] += 1
                n[1] += 1
                loop.create_task(_connect(loop, protocol, sock, config.ssl, n))
            counters.set(index, _OPEN, open_now())
            counters.set(index, _RECEIVED, n[0])

    def report() -> None:
        counters.set(index, _OPEN, open_now())
        if counters.get(index, _READY) == SERVING and attached():
            counters.set(index, _READY, ATTACHED)
        if not server.should_exit:
            loop.call_later(REPORT_S, report)

    link.setblocking(False)
    loop.add_reader(link.fileno(), readable)
    counters.set(index, _READY, ATTACHED if attached() else SERVING)
    report()


async def _connect(loop, protocol, sock: socket.socket, ssl, n: array.array) -> None:
    try:
        await loop.connect_accepted_socket(protocol, sock, ssl=ssl)
    except OSError:  # the client left before the worker took it
        sock.close()
    finally:
        n[1] -= 1
