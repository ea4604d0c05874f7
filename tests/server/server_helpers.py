"""Helpers shared by the server tests."""
from __future__ import annotations

import io
import socket
import sys
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import uvicorn

sys.path.insert(0, str(Path(__file__).parents[1] / "audio"))  # audio_files: WAVs built byte by byte
from audio_files import raw_wav  # noqa: E402,F401

SHORT_MS = 400  # 5 frames: keeps the CPU tests quick


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, app, sndbuf: int | None = None) -> None:
        """sndbuf: the listening socket's SO_SNDBUF (inherited by its connections): a client that stops
        reading blocks the server's writes after that many bytes rather than after megabytes."""
        from csmserve.server.timeouts import uvicorn_config

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw = dict(host="127.0.0.1", port=self.port, log_level="warning", ws="websockets-sansio")
        state = getattr(app.state, "server", None)  # a csmserve app: the transport limits `csmserve serve` runs with
        config = uvicorn_config(app, state.config, **kw) if state is not None else uvicorn.Config(app, **kw)
        self.server = uvicorn.Server(config)
        sockets = None
        if sndbuf is not None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            sock.bind(("127.0.0.1", self.port))
            sockets = [sock]
        self.thread = threading.Thread(target=lambda: self.server.run(sockets=sockets), daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def start(self) -> Server:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def wait_slots_free(csm, timeout: float = 10.0) -> int:
    """Wait until every engine slot is free and nothing waits (the engine's own counters)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = csm.client.stats()
        if s.free_slots == s.max_slots and not s.waiting:
            break
        time.sleep(0.02)
    return csm.client.stats().free_slots


def decode_24k(data: bytes, fmt: str) -> np.ndarray:
    """Any response body -> [n] float32 mono at 24 kHz (PyAV; Opus decodes at 48 kHz, resampled)."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767
    resampler = av.AudioResampler(format="flt", layout="mono", rate=24_000)
    out = []
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(c.streams.audio[0]):
            out += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(out)


def wav_bytes(seconds: float = 1.0, sr: int = 16_000, hz: float = 220.0) -> bytes:
    """A mono 16-bit wav of a tone (at a rate the server must resample)."""
    pcm = (0.4 * np.sin(2 * np.pi * hz * np.arange(int(seconds * sr)) / sr) * 32767).astype("<i2")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=sr)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = sr
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


class ProcServer:
    """`csmserve serve --api-workers N` as users run it: a subprocess tree (parent, engine-core process,
    N API workers) on 127.0.0.1:<free port>; flags from ServerConfig / EngineConfig field names."""

    def __init__(self, tmp_path, workers: int = 2, model: str = "dummy-tiny", new_session: bool = False,
                 **flags) -> None:
        """new_session: the tree in a process group of its own (os.killpg(server.proc.pid, SIGKILL) ends it all)."""
        import os
        import subprocess
        import sys

        self.port = free_port()
        self.workers = workers
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        flags = {"max_slots": 32, "max_seq_len": 512, "first_chunk_frames": 1, "chunk_frames": 2, "model_name": "sesame/csm-1b",
                 "voices_db": str(tmp_path / f"voices-{self.port}.db"), "default_audio_length_ms": SHORT_MS,
                 "device": "cpu", **flags}
        cmd = [sys.executable, "-m", "csmserve", "serve", "--model", model, "--port", str(self.port),
               "--api-workers", str(workers)]
        for k, v in flags.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)
        self.state = None  # nothing in-process to look into: tests use the public API only

    def start(self, timeout: float = 120.0) -> "ProcServer":
        """Returns once every API worker has answered /ready 200: until a worker is attached to the engine,
        new connections go to the attached ones only (server/dispatch.py), so tests that need both would
        otherwise race the second one's attach."""
        deadline = time.time() + timeout
        ready: set[str] = set()
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"csmserve serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(f"{self.url}/ready", timeout=2)
                if r.status_code == 200:
                    ready.add(r.headers.get("x-csmserve-worker", "0"))
                    if len(ready) >= self.workers:
                        return self
                    time.sleep(0.02)  # the next connection goes to the next attached worker in turn
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready in {timeout} s: {self.log_path.read_text()[-3000:]}")

    def pids(self) -> dict:
        """{'engine': pid, 'workers': {index: pid of its latest start}} from the parent's log."""
        import re

        text = self.log_path.read_text()
        engine = re.findall(r"engine process \(pid (\d+)\)", text)
        workers = {int(i): int(p) for i, p in re.findall(r"API worker (\d+) started \(pid (\d+)\)", text)}
        return {"engine": int(engine[-1]) if engine else None, "workers": workers}

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.log.close()


def metric(server, name: str) -> float:
    """A sample's value from GET /metrics (the first line starting with `name`)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def metrics(server, *names: str) -> tuple[float, ...]:
    """Several samples from one GET /metrics (one API worker's snapshot of the engine's counters)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    return tuple(next(float(line.rsplit(" ", 1)[1]) for line in text if line.startswith(n) and not line.startswith("#"))
                 for n in names)


def wait_metrics(server, until, *names: str, timeout: float = 10.0) -> tuple[float, ...]:
    """metrics(server, *names) once until(values) holds, or the last values at the deadline. With several
    API workers, /metrics may be answered by one whose copy of the engine's counters is a heartbeat old."""
    deadline = time.time() + timeout
    while True:
        values = metrics(server, *names)
        if until(values) or time.time() > deadline:
            return values
        time.sleep(0.05)


def wait_idle(server, timeout: float = 15.0) -> bool:
    """Until the engine holds no request (its own gauges, over /metrics): every slot free."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(server, "csmserve:num_requests_running") == 0 and metric(server, "csmserve:num_requests_waiting") == 0:
            return True
        time.sleep(0.05)
    return False
