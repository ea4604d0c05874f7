"""The server under test: `csmserve serve` started as a subprocess (or one already running, --url),
readiness, stored voices made for the benchmark, and a quiet server between scenarios."""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np

VOICE_TRANSCRIPT = "This is the reference clip of a benchmark voice, read at an even pace."


def raise_fd_limit() -> None:
    """Thousands of sockets: lift the soft open-files limit to the hard one (the server inherits it)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m csmserve serve --host 127.0.0.1 --port P ARGS...`, its output in `log_path`."""

    def __init__(self, args: list[str], log_path: str | Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "csmserve", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     *args]
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> str:
        raise_fd_limit()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        # a session of its own: stop() can end every process it starts (API workers, an engine process)
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        try:
            wait_ready(self.url, timeout, self)
        except BaseException:
            self.stop()
            raise
        return self.url

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig) if sig == signal.SIGKILL else p.send_signal(sig)
            except ProcessLookupError:
                return
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # whatever it started and left behind in its session
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def wait_ready(url: str, timeout: float, server: ServerProcess | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if server is not None and not server.alive():
            raise RuntimeError(f"the server exited (code {server.proc.returncode}) before it was ready:\n"
                               f"{server.log_tail()}")
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                return
            if r.status_code == 404:  # a server without /ready (e.g. behind a proxy): /health then
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready after {timeout:g} s ({last})"
                       + (f":\n{server.log_tail()}" if server is not None else ""))


def voice_wav(seconds: float = 5.0, rate: int = 24_000, seed: int = 0) -> bytes:
    """A speech-like clip: a gliding harmonic tone with a syllable-rate envelope, 16-bit mono."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 20 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    pcm = (0.25 * tone * envelope / np.abs(tone).max() * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def create_voices(url: str, n: int, headers: dict, prefix: str = "bench-voice") -> list[str]:
    """POST /v1/audio/voices n times (a generated clip each) -> their ids."""
    import httpx

    ids = []
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        for i in range(n):
            r = client.post("/v1/audio/voices", data={"name": f"{prefix}-{i}", "transcript": VOICE_TRANSCRIPT},
                            files={"audio_sample": (f"voice{i}.wav", voice_wav(seed=i), "audio/wav")})
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/audio/voices: HTTP {r.status_code}: {r.text[:200]}")
            ids.append(r.json()["id"])
    return ids


def delete_voices(url: str, ids: list[str], headers: dict) -> None:
    import httpx

    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for vid in ids:
            try:
                client.delete(f"/v1/audio/voices/{vid}")
            except httpx.HTTPError:
                pass
