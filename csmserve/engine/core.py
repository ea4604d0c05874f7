"""The engine-core process: the engine loop alone in its own interpreter, API workers on connections.

    serve_engine(spec, load, ready)  # process entry: load(spec) the model, start listening, loop forever

Typed messages in (engine/messages.py) from every API worker's connection, polled by the loop itself
(no other Python thread competes for this process's GIL on the frame path: accepting connections
and encoding uploaded audio run on two helper threads that sleep otherwise, each connection's
handshake on a thread of its own for its milliseconds). One message out per engine step to each
worker that has rows or events in it: the `EngineStep` (small arrays); its codes and PCM are read
by the workers from the shared-memory output ring (engine/output_ring.py) the step's device-to-host
copy wrote into. When no step runs, every worker still gets the engine's counters a few times a
second (and so notices a lost device at once).

A worker that disconnects (its process died) has its requests aborted; the engine goes on. So has one
whose connection stays full for reader_wait_s (the worker frozen: SIGSTOP, a cgroup freezer, swapped out):
a blocking send to it would stop the loop, every other worker's streams with it; it is dropped (closed)
instead, and exits to be restarted once it runs again (engine/remote.py). The
process that started the engine (spec.parent_pid: `csmserve serve`'s parent, a Ray replica) gone, the
engine removes its ring file and socket and exits: no orphan holding the GPU.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import signal
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge, wait
from typing import Any

import numpy as np
import torch

from csmserve.config import EngineConfig
from csmserve.engine import messages as m
from csmserve.engine.engine import ABORT, ADAPTERS, ADD, APPEND, CLOSE, Engine, Inbox, build_engine
from csmserve.engine.outputs import EngineStats, EngineStep, error_payload
from csmserve.engine.output_ring import StepOutput

log = logging.getLogger("csmserve.engine")
RING_SLOTS = 12  # steps a worker may lag before its rows are overwritten (~1 s at 2,048 streams)
HEARTBEAT_S = 0.25
PARENT_POLL_S = 0.5  # how often the engine checks that the process that started it is alive
HELLO_S = 10.0  # a worker's handshake and Hello take milliseconds: a connection silent this long is closed
MIN_SEND_S = 0.1  # a send's wait for room in a worker's socket with reader_wait_s 0 (0 would be no bound at all)


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine-core process needs, built at the edge (csmserve serve)."""

    model: str
    device: str | None
    dtype: str | None
    codec: str | None
    codec_dtype: str | None
    engine: EngineConfig
    address: str  # the Unix socket workers connect to
    authkey: bytes
    ring_path: str  # the output ring's shared-memory file
    log_level: str = "info"
    # the process that started this one: once it is gone (killed, its shutdown never ran) the engine exits
    parent_pid: int | None = None


class Connections(Inbox):
    """The loop's inbox: every worker connection, polled; accepted on a helper thread."""

    def __init__(self, listener: Listener, welcome: m.Welcome, authkey: bytes, send_timeout_s: float = 0.0) -> None:
        """send_timeout_s: how long a send may wait for room in a worker's socket before that worker is dropped
        (the engine's reader_wait_s; 0: a floor of MIN_SEND_S, never unbounded)."""
        super().__init__()
        self.listener, self.welcome, self.authkey = listener, welcome, authkey
        self.send_timeout_s = max(send_timeout_s, MIN_SEND_S)
        self.calls: dict[type, _Calls] = {}  # the messages with a call_id -> the helper thread that answers them
        self.conns: dict[Connection, int] = {}  # connection -> client id
        self.by_client: dict[int, Connection] = {}
        self.locks: dict[int, threading.Lock] = {}
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self.gone: list[tuple[int, str]] = []  # (client, why) whose connection closed, for the engine to abort
        self._behind: list[tuple[int, Connection]] = []  # sends that timed out, for the loop to close (get)
        threading.Thread(target=self._accept, name="csmserve-accept", daemon=True).start()

    def _accept(self) -> None:
        # the listener has no authkey: its accept() would run the handshake here, and one peer that stalls in it
        # (or sends a wrong digest: AuthenticationError) would stop every later worker from attaching
        while True:
            try:
                conn = self.listener.accept()
            except OSError as e:
                log.warning("a worker failed to connect: %s", e)
                continue
            threading.Thread(target=self._attach, args=(conn,), name="csmserve-attach", daemon=True).start()

    def _attach(self, conn: Connection) -> None:
        """One connection's handshake (the authkey's challenge both ways, then its Hello for our Welcome)."""
        try:
            _timeouts(conn, HELLO_S)
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            hello = pickle.loads(conn.recv_bytes())
            # an id that is not an int breaks the loop where it is used (the ring's ack entry when it leaves)
            if not isinstance(hello, m.Hello) or not isinstance(hello.client_id, int):
                raise ValueError(f"not a Hello: {hello!r:.100}")
            conn.send_bytes(pickle.dumps(self.welcome, protocol=5))
            # attached: a send gives up past send_timeout_s (a frozen worker's full socket would block the loop, every
            # stream of every worker), and so does a read (the loop reads a message whole once its first bytes came:
            # a worker frozen mid-message would hold it the same way)
            _timeouts(conn, self.send_timeout_s)
        except Exception as e:  # noqa: BLE001 - whatever the peer sent (a bad pickle, digest, a timeout): it alone
            why = f"silent for {HELLO_S:g} s" if isinstance(e, BlockingIOError) else f"{type(e).__name__}: {e}"
            log.warning("a worker failed to connect: %s", why)
            conn.close()
            return
        self._new.put((conn, hello.client_id))
        self._wake_w.send(b"x")

    def send(self, client: int, msg: object) -> None:
        conn = self.by_client.get(client)
        if conn is None:
            return
        data = pickle.dumps(msg, protocol=5)
        try:
            with self.locks[client]:
                conn.send_bytes(data)
        except BlockingIOError:  # SO_SNDTIMEO: its socket full for send_timeout_s
            # part of the message may be written (the stream is unusable): no more sends; the loop closes it (this
            # may be a helper thread's _reply, and the loop's wait() polls the connection)
            if self.by_client.pop(client, None) is conn:
                self._behind.append((client, conn))
        except (OSError, ValueError):
            pass  # gone: noticed by the poll

    def clients(self) -> list[int]:
        return list(self.by_client)

    def get(self, block: bool) -> list[tuple]:
        out = super().get(False)  # anything the engine queued for itself
        while not self._new.empty():
            conn, cid = self._new.get()
            self.conns[conn], self.by_client[cid], self.locks[cid] = cid, conn, threading.Lock()
        while self._behind:
            cid, conn = self._behind.pop()
            if self.conns.pop(conn, None) is not None:  # (not already seen closed by the poll)
                conn.close()  # EOF for the worker once it runs again: it exits and is restarted
                self.gone.append((cid, f"fell behind (its connection full for {self.send_timeout_s:g} s: frozen, "
                                       "swapped out?): dropped"))
        ready = wait([*self.conns, self._wake_r], timeout=HEARTBEAT_S if block and not out else 0)
        for conn in ready:
            if conn is self._wake_r:
                self._wake_r.recv(4096)
                continue
            cid = self.conns[conn]
            try:
                while conn.poll():
                    out += self._message(cid, pickle.loads(conn.recv_bytes()))
            except BlockingIOError:  # SO_RCVTIMEO: the rest of a message not come in send_timeout_s
                del self.conns[conn]
                self.by_client.pop(cid, None)
                conn.close()  # part of a message read: unusable; EOF for the worker once it runs again
                self.gone.append((cid, f"stopped mid-message for {self.send_timeout_s:g} s (frozen?): dropped"))
            except (EOFError, OSError):
                del self.conns[conn]
                self.by_client.pop(cid, None)
                self.gone.append((cid, "disconnected"))
        return out

    def _message(self, client: int, msg: object) -> list[tuple]:
        if isinstance(msg, m.Submit):
            return [(ADD, msg.request, None)]
        if isinstance(msg, m.Abort):
            return [(ABORT, msg.request_id, None)]
        if isinstance(msg, m.Append):
            return [(APPEND, msg.request_id, (msg.tokens, msg.mask))]
        if isinstance(msg, m.Close):
            return [(CLOSE, msg.request_id, None)]
        if type(msg) in self.calls:
            self.calls[type(msg)].put(client, msg)
            return []
        log.warning("unknown message from worker %d: %r", client, type(msg).__name__)
        return []


def _timeouts(conn: Connection, seconds: float, send_s: float | None = None) -> None:
    """The connection's socket reads (and writes, or past `send_s`) fail (EAGAIN) past `seconds` (0: never)."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a dup: the same socket
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds if send_s is None else send_s))


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


class _Calls:
    """Workers' calls answered on a helper thread of their own (never on the loop): `answer(msg)` -> a Future
    (or the result), its outcome sent back as a Reply."""

    def __init__(self, name: str, answer: Callable[[Any], Any], conns: Connections) -> None:
        self.answer, self.conns, self.q = answer, conns, queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, client: int, msg: Any) -> None:
        self.q.put((client, msg))

    def _run(self) -> None:
        while True:
            client, msg = self.q.get()
            fut: Future = Future()
            try:
                result = self.answer(msg)
                if isinstance(result, Future):
                    fut = result
                else:
                    fut.set_result(result)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                fut.set_exception(e)
            fut.add_done_callback(lambda f, c=client, i=msg.call_id: self._reply(c, i, f))

    def _reply(self, client: int, call_id: int, fut: Future) -> None:
        e = fut.exception()
        self.conns.send(client, m.Reply(call_id, None if e else fut.result(), error_payload(e) if e else None))


def _encoder(csm) -> Callable[[m.Encode], np.ndarray]:
    """Mimi-encodes an uploaded clip (voices, context audio) on its own CUDA stream."""
    stream = torch.cuda.Stream() if csm.device.type == "cuda" else None

    def encode(msg: m.Encode) -> np.ndarray:
        with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else nullcontext()):
            return csm.encode_audio(msg.audio)
    return encode


def _adapter_calls(engine: Engine) -> Callable[[Any], Future]:
    """A load's directory is read on the helper thread (seconds for a large one), then the engine loop registers it
    (or unloads, or lists): the loop's Future."""

    def call(msg) -> Future:
        if isinstance(msg, m.LoadAdapter):
            return engine.load_adapter(msg.name, msg.path)  # read here, registered by the loop
        if isinstance(msg, m.UnloadAdapter):
            return engine.unload_adapter(msg.name)
        fut: Future = Future()
        engine.inbox.put((ADAPTERS, None, fut))
        return fut
    return call


class CoreLoop:
    """Drives the Engine: one run_once() per iteration, its outputs to the workers, heartbeats between."""

    def __init__(self, engine: Engine, conns: Connections) -> None:
        self.engine, self.conns = engine, conns
        self._sent: dict[int, float] = {}
        engine.emit = self._emit

    def _emit(self, client: int, step: EngineStep, out: StepOutput | None) -> None:
        self.conns.send(client, step)
        self._sent[client] = time.monotonic()

    def run(self) -> None:
        with torch.inference_mode():
            while True:
                self.engine.run_once()
                for cid, why in self.conns.gone:
                    log.warning("worker %d %s: its requests are aborted", cid, why)
                    self.engine.abort_client(cid)
                self.conns.gone.clear()
                self._heartbeat()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        stats: EngineStats | None = None
        for cid in self.conns.clients():
            if now - self._sent.get(cid, 0.0) >= HEARTBEAT_S:
                stats = stats or self.engine.engine_stats()
                z = np.zeros(0, np.int64)
                self._emit(cid, EngineStep(-1, -1, z, z, z, z, np.zeros(0, bool), np.zeros(0, np.uint8),
                                           np.zeros(0, bool), [], stats), None)


def freeze_gc() -> None:
    """After a process has loaded (torch, the model, the app): its ~200-300k objects out of the collector's
    reach (gc.freeze), so a full collection walks only what was made since, not every module and tensor
    (a gen-2 pass over them stalls the loop for tens to hundreds of ms, every stream with it)."""
    import gc

    gc.collect()
    gc.freeze()


def exit_with_parent(parent_pid: int | None, paths: tuple[str, ...] = (), what: str = "the engine",
                     poll_s: float = PARENT_POLL_S) -> threading.Thread | None:
    """Exit once the process that started this one is gone (parent_pid; SIGKILLed, a Ray actor killed:
    nobody stops us): a helper thread checks getppid() every poll_s, then removes `paths` (the engine's
    ring file and socket) and exits. Not PR_SET_PDEATHSIG: that fires when the *thread* that started the
    process ends (a Ray replica starts it from one of Ray's threads), and a signal would leave the files
    behind. `csmserve serve`'s API workers use it too (what: "API worker N")."""
    if parent_pid is None:
        return None

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("the process that started %s (pid %d) is gone: exiting", what, parent_pid)
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        os._exit(0)

    t = threading.Thread(target=watch, name="csmserve-parent", daemon=True)
    t.start()
    return t


def serve_engine(spec: EngineSpec, load: Callable[[EngineSpec], Any], ready: Connection | None = None) -> None:
    """The engine-core process's main: load, listen on spec.address, loop until killed (or the parent is gone).

    load(spec): the loaded model, engine-less (the server's `CSM`: .model, .mimi, .encode_audio, .config,
    .device, .model_name, .model_dir, .frame_size, .build_engine; its .engine_config, if set, is the engine's:
    load may size max_slots); a module-level function (or a partial of one), so that it pickles."""
    logging.basicConfig(level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    # Ctrl-C reaches every process of the group: the parent stops the workers first (their streams end), then this
    # one; a KeyboardInterrupt here would cut the streams they are still finishing
    if threading.current_thread() is threading.main_thread():  # (tests run it on a thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(spec.parent_pid, (spec.ring_path, spec.address))
    try:
        csm = load(spec)
        config = getattr(csm, "engine_config", None) or spec.engine
        if hasattr(csm, "build_engine"):  # CSM: its model's engine (or the paced stand-in's, engine/paced.py)
            engine = csm.build_engine(config, start=False, ring_path=spec.ring_path, ring_slots=RING_SLOTS)
        else:
            engine = build_engine(csm.model, csm.mimi, config, start=False, ring_path=spec.ring_path,
                                  ring_slots=RING_SLOTS)
        take = getattr(csm, "take_adapters", None)  # CSM(adapters=...): read by load, served from the first step
        if take is not None:
            engine.register_adapters(take())
        welcome = m.Welcome(m.EngineInfo.of(csm, engine), engine.runner.ring.spec(), os.getpid())
        if os.path.exists(spec.address):
            os.unlink(spec.address)
        listener = Listener(spec.address, family="AF_UNIX")  # authenticated by Connections, per connection
    except Exception as e:
        if isinstance(e, ValueError):  # the caller's input (a LoraError of --lora, a bad model): its one line
            log.error("the engine failed to start: %s", " ".join(str(e).split()))
        else:
            log.exception("the engine failed to start")
        if ready is not None:
            ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e
    freeze_gc()
    conns = Connections(listener, welcome, spec.authkey, config.reader_wait_s)
    adapter_calls = _Calls("csmserve-adapters", _adapter_calls(engine), conns)
    conns.calls = {m.Encode: _Calls("csmserve-encode", _encoder(csm), conns), m.LoadAdapter: adapter_calls,
                   m.UnloadAdapter: adapter_calls, m.ListAdapters: adapter_calls}
    engine.inbox = conns
    log.info("engine ready: %d slots, max_seq_len %d, listening on %s", engine.scheduler.max_slots,
             config.max_seq_len, spec.address)
    if ready is not None:
        ready.send(("ready", welcome.info))
    CoreLoop(engine, conns).run()
