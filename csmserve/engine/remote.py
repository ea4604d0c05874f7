"""An API worker's door to the engine-core process: the same EngineClient surface over a connection.

A reader thread receives one EngineStep per engine step, gathers this worker's rows of codes and PCM
out of the shared-memory output ring at once (checking the ring buffer still holds that step), and
hands the step to the worker's event loop in one call; there the Router groups frames into chunks
and wakes each consumer at most once. Submit / abort / append / close are messages; `encode` is a
call answered by the engine's encoder thread.

If the connection drops (the engine process died), every open stream ends with an error, every later
request is refused at once, and `fatal` says so: the worker's /health answers 503. A connection the engine
closed while it still runs dropped this worker (its socket stayed full: the worker was frozen; engine/core.py):
with `on_dropped` (an API worker's: exit, to be restarted by its parent) that is called instead. An engine that hangs
(a GPU hang, a deadlock) keeps its connection: `last_word`, when it last sent anything (a step, a heartbeat
every core.HEARTBEAT_S, a reply), is what tells (ServerState.engine_stalled).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Client

import numpy as np

from csmserve.engine import messages as m
from csmserve.engine import trace
from csmserve.engine.client import ClientBase
from csmserve.engine.output_ring import READERS, OutputRing
from csmserve.engine.outputs import CLIENT_SHIFT, EV_ERROR, EngineStep, Event, Router, error_from, error_payload
from csmserve.engine.request import Request

log = logging.getLogger("csmserve.engine")
# how long the engine's process must go on running after its connection closed to count as alive (it dropped this
# worker): a dying one closes its sockets in its last moments, then is a zombie (or gone) within milliseconds
DEATH_GRACE_S = 2.0


class EngineGone(RuntimeError):
    """The engine-core process is gone."""


class RemoteEngineClient(ClientBase):
    def __init__(self, address: str, authkey: bytes, client_id: int, timeout: float = 0.0,
                 on_dropped: Callable[[], None] | None = None) -> None:
        """Connect (retrying up to `timeout` seconds while the engine starts) and read its Welcome. on_dropped:
        called (on the reader thread, open streams ended) if the engine closes the connection and still runs."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn = Client(address, family="AF_UNIX", authkey=authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.conn.send_bytes(pickle.dumps(m.Hello(client_id), protocol=5))
        welcome: m.Welcome = pickle.loads(self.conn.recv_bytes())
        self.info = welcome.info
        self.engine_pid, self.on_dropped = welcome.pid, on_dropped
        self.last_word = time.monotonic()
        cfg = welcome.info.engine
        super().__init__(Router.of(cfg, welcome.info.num_codebooks, self.abort), client_id)
        self.ring = OutputRing.attach(welcome.ring)
        self._ack = client_id % READERS
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._n = itertools.count()  # this worker's request handles
        self._fatal: str | None = None
        self._closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tracer = None  # EngineConfig.trace_requests: this worker's stamps (engine/trace.py)
        if cfg.trace_requests:
            self.tracer = trace.start(cfg.trace_requests, "worker", client=client_id)
            self.tracer.run_flusher()
        self._reader = threading.Thread(target=self._read, name="csmserve-engine-reader", daemon=True)
        self._reader.start()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver on this event loop (the worker's): every consumer lives there."""
        self.loop = loop

    # ---- to the engine
    def _send(self, msg: object) -> None:
        if self._fatal is not None:
            raise EngineGone(self._fatal)
        data = pickle.dumps(msg, protocol=5)
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError) as e:
            raise EngineGone(f"the engine process is gone ({e})") from None

    def _start(self, request: Request, sink, max_lag_s=None, progress=None) -> None:
        request.handle = (self.client_id << CLIENT_SHIFT) | next(self._n)
        request.arrival_time = request.arrival_time or time.perf_counter()
        self._on_loop(self.router.open, request.handle, request.request_id, sink, max_lag_s, progress)
        if self._fatal is not None:
            self._on_loop(self.router.event, Event(request.handle, EV_ERROR, error_payload(EngineGone(self._fatal))))
            return
        try:
            if self.tracer is not None:  # handed to the connection (the engine may read it before send returns)
                self.tracer.stamp(request.request_id, sent=time.perf_counter())
            self._send(m.Submit(request))
        except EngineGone as e:
            self._on_loop(self.router.event, Event(request.handle, EV_ERROR, error_payload(e)))

    def _post(self, msg: object) -> None:
        """A message about a request already sent: with the engine gone, its stream has ended already."""
        try:
            self._send(msg)
        except EngineGone:
            pass

    def abort(self, request_id: str) -> None:
        self._post(m.Abort(request_id))

    def append(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> None:
        self._post(m.Append(request_id, tokens, mask))

    def close(self, request_id: str) -> None:
        self._post(m.Close(request_id))

    def _call(self, msg_of, timeout: float):
        """msg_of(call_id) sent -> its Reply's result (or its error raised), within timeout s."""
        call = next(self._call_ids)
        fut: Future = Future()
        self._calls[call] = fut
        try:
            self._send(msg_of(call))
            return fut.result(timeout)
        finally:
            self._calls.pop(call, None)

    # the adapter calls (ClientBase says what they do): `path` is read by the engine process, the errors are the
    # engine's
    def load_adapter(self, name: str, path: str, timeout: float = 300.0) -> dict:
        return self._call(lambda c: m.LoadAdapter(c, name, str(path)), timeout)

    def unload_adapter(self, name: str, timeout: float = 60.0) -> dict:
        return self._call(lambda c: m.UnloadAdapter(c, name), timeout)

    def adapters(self, timeout: float = 60.0) -> dict[str, dict]:
        return self._call(m.ListAdapters, timeout)

    def encode(self, audio: np.ndarray, timeout: float = 120.0) -> np.ndarray:
        """Mimi codes [frames, K] of a 24 kHz waveform, encoded by the engine process (blocking)."""
        return self._call(lambda c: m.Encode(c, np.ascontiguousarray(audio, dtype=np.float32)), timeout)

    # ---- from the engine
    def _on_loop(self, fn, *args) -> None:
        loop = self.loop
        if loop is None or _running_loop() is loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _read(self) -> None:
        try:
            while True:
                msg = pickle.loads(self.conn.recv_bytes())
                self.last_word = time.monotonic()
                if isinstance(msg, EngineStep):
                    self._step(msg, time.perf_counter() if self.tracer is not None else 0.0)
                elif isinstance(msg, m.Reply):
                    fut = self._calls.get(msg.call_id)
                    if fut is not None:
                        if msg.error is not None:
                            fut.set_exception(error_from(msg.error))
                        else:
                            fut.set_result(msg.result)
        except (EOFError, OSError) as e:
            if self._closing:  # our own shutdown(): nothing was lost
                return
            if self.on_dropped is not None and self.engine_pid is not None and _runs(self.engine_pid, DEATH_GRACE_S):
                log.error("the engine dropped this worker (it fell behind): exiting to be restarted")
                self._gone("the engine dropped this API worker (it fell behind)", quiet=True)
                self.on_dropped()
                return
            self._gone(f"the engine process exited ({type(e).__name__})")
        except Exception as e:  # noqa: BLE001 - a broken message stream is the same as a lost engine
            if self._closing:  # shutdown() closed the connection under recv_bytes (TypeError: its handle is None)
                return
            log.exception("reading from the engine failed")
            self._gone(f"reading from the engine failed: {e}")

    def _step(self, step: EngineStep, t_recv: float = 0.0) -> None:
        codes = pcm = None
        if len(step.rows):
            r = step.ring
            codes = self.ring["codes"][r][step.rows]  # copies, taken at once: the buffer is reused
            pcm = self.ring["pcm"][r][step.rows] if "pcm" in self.ring else None
            if self.ring["header"][r] != step.step:  # overwritten meanwhile: this worker fell too far behind
                err = error_payload(RuntimeError("this API worker fell behind the engine; the stream was lost"))
                step.events = step.events + [Event(int(h), EV_ERROR, err) for h in step.handles]
                self._on_loop(self._let_go, step.handles.copy())  # before the errors end the streams
                step.handles = np.full_like(step.handles, -1)
            self.ring["acks"][self._ack] = step.step  # read: the engine may reuse the buffer
        if self.tracer is not None and step.step >= 0:  # not a heartbeat
            self._on_loop(self._traced_deliver, step, codes, pcm, t_recv)
            return
        self._on_loop(self.router.deliver, step, codes, pcm)

    def _let_go(self, handles: np.ndarray) -> None:
        """The requests of rows this worker lost: aborted at the engine too (a consumer whose stream raised does
        not abort it, and an open long-form request would hold its slot)."""
        for h in handles:
            st = self.router.streams.get(int(h))
            if st is not None:
                self.abort(st.request_id)

    def _traced_deliver(self, step: EngineStep, codes, pcm, t_recv: float) -> None:
        self.tracer.row("recv", step.step, t_recv, time.perf_counter(), len(step.rows))
        self.router.deliver(step, codes, pcm)

    def _gone(self, reason: str, quiet: bool = False) -> None:
        self._fatal = reason
        if not quiet:
            log.critical("%s: open streams end with an error; /health answers 503", reason)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineGone(reason))
        self._on_loop(self.router.fail_all, EngineGone(reason))

    def _async_sink(self, loop, q, request_id):
        if loop is self.loop:  # deliveries run on this loop already: no extra wake-up per chunk
            return q.put_nowait
        return super()._async_sink(loop, q, request_id)

    # ---- state (stats(): the counters the engine sends with every step and heartbeat, in the router)
    @property
    def fatal(self) -> str | None:
        return self._fatal or super().fatal

    def shutdown(self) -> None:
        self._closing = True
        try:
            self.conn.close()
        except OSError:
            pass


def _runs(pid: int, grace_s: float) -> bool:
    """Whether process `pid` is still running (not a zombie, not gone) `grace_s` from now."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:  # "pid (comm) S ...": comm may hold spaces and parentheses
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone (or no /proc: as before, the engine counts as dead)
            return False
        if state in ("Z", "X"):  # exited, not yet reaped by its parent
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
