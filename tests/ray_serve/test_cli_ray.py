"""`csmserve serve --ray` itself: a subprocess that starts its own local Ray instance, serves on --port,
and stops on SIGTERM or Ctrl-C."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_serve_ray_cli(tmp_path):
    pytest.importorskip("ray.serve")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "csmserve", "serve", "--ray", "--model", "dummy-tiny", "--device", "cpu",
           "--num-replicas", "1", "--cpus-per-replica", "0.5", "--max-slots", "2", "--max-seq-len", "256",
           "--port", str(port), "--voices-db", str(tmp_path / "v.db"), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(f"{url}/ready", timeout=5)
                if r.status_code == 200 and r.json()["replicas"]["ready"] == 1:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "csmserve serve --ray did not get ready"
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/audio/speech", timeout=60, json={
            "model": "tts-1", "voice": "alloy", "input": "From the command line.", "response_format": "pcm",
            "max_audio_length_ms": 160})
        assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2 and r.headers["x-csmserve-replica"]
        # (/ready may answer before `serve.run` has returned: the signal then lands while it still waits)
    finally:
        proc.send_signal(signal.SIGTERM)  # a container stop (Ctrl-C: SIGINT, the same path)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
