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
    def __init__(self, app) -> None:
        from csmserve.server.timeouts import uvicorn_config

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kw = dict(host="127.0.0.1", port=self.port, log_level="warning", ws="websockets-sansio")
        state = getattr(app.state, "server", None)  # a csmserve app: the transport limits `csmserve serve` runs with
        config = uvicorn_config(app, state.config, **kw) if state is not None else uvicorn.Config(app, **kw)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

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
    sched = csm.client.engine.scheduler
    deadline = time.time() + timeout
    while time.time() < deadline and (sched.num_free_slots < sched.max_slots or sched.has_unfinished()):
        time.sleep(0.02)
    return sched.num_free_slots


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
