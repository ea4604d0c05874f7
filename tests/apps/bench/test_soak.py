"""The soak, 2 minutes on the CPU: `bench/soak.py` against `csmserve serve --model dummy-tiny --api-workers 2`
(an engine-core process and two API workers), 12 users in 2 client processes for 90 s: speech in pcm / mp3
/ opus / wav, requests cut mid-stream by FIN and RST, hostile requests (hostile.py, every one answered as
it must be), voices created, used and deleted, WebSocket conversations with hostile messages and cut
turns between their turns. Shown: 0 responses >= 500, 0 failures of any kind, 0 crashes (every server
process's pid alive, none restarted), 0 slots in use after, voices consistent (alive: listed and usable;
deleted: 404), memory of the engine and the workers growing < 200 MB, TTFA in every 30 s window.

The engine's prefix cache is 8 MiB here (64 MiB on the CPU by default): it fills in the first seconds and then
evicts under the churn of conversations and voices, so what the engine's memory does after is not the cache
filling up (measured: with 8 MiB the engine's RSS is flat once full; with 64 MiB it climbs for minutes)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DURATION = 90  # with the server start and the checks, ~2 minutes (the "2-minute CPU version"; CI's 20 minutes)


def test_soak_on_the_cpu(tmp_path):
    out = tmp_path / "soak"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--model", "dummy-tiny", "--device", "cpu",
           "--api-workers", "2", "--users", "12", "--client-procs", "2", "--duration", str(DURATION),
           "--audio-ms", "240,800", "--hostile", "0.1", "--server-args", "--prefix-cache-bytes 8388608",
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DURATION + 150)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert time.monotonic() - t < DURATION + 60
    s = json.loads(out.with_suffix(".json").read_text())
    assert s["meta"]["stopped_by"] == "duration" and s["meta"]["roles"] == {"http": 9, "ws": 2, "voice": 1}
    # nothing failed: every request, turn and voice operation ended as it must (or was cut by the stop)
    assert s["server_errors"] == 0 and s["server_5xx"] == 0, s["failures"]
    assert s["failures"] == {} and s["requests"]["failed"] == 0, s["failure_examples"]
    kinds = s["by_kind"]
    for kind in ("speech-pcm", "speech-mp3", "speech-opus", "speech-wav", "disconnect-fin", "disconnect-rst",
                 "hostile-http", "hostile-ws", "ws-turn", "ws-close", "voice-create", "voice-use", "voice-delete",
                 "voice-gone"):
        assert kinds.get(kind, {}).get("ok", 0) > 0, (kind, kinds)
    assert sum(v["n"] for k, v in kinds.items() if k.startswith("ws-disconnect-")) > 0, kinds
    assert s["client_disconnects"]["all"] >= 20 and s["requests"]["ok"] >= 300, s["requests"]
    # hostile: each answered with its status, errors in OpenAI's shape with a non-null code (its code)
    h = s["hostile"]
    assert h["n"] >= 20 and h["as_expected"] == h["n"] - h["cut_by_stop"], h
    assert h["cases_sent"] >= h["cases"] // 2, h
    # no crash: the pids found at the start all alive, no process (re)started
    assert set(s["meta"]["server_processes"].values()) == {"parent", "engine", "api-0", "api-1"}
    assert s["crashes"] == {"exited": [], "appeared": []}
    assert s["slots_after"]["running"] == 0 and s["slots_after"]["waiting"] == 0, s["slots_after"]
    v = s["voices"]
    assert v["problems"] == [] and v["deleted_checked"] > 0 and v["live_checked"] > v["stored"], v
    growth = s["memory"]["growth_mb"]
    for name in ("engine", "api-0", "api-1"):
        assert growth[name] < 200, growth
    windows = s["ttfa_windows"]
    assert len(windows) == DURATION // 30 and all(w["http"]["n"] > 0 and w["http"]["p99"] > 0 for w in windows), windows
    assert "## Soak: 12 users" in p.stdout and "| slots in use after | 0 running, 0 waiting" in p.stdout
