"""`csmserve bench --serve` end to end on the CPU: it starts a dummy-tiny `csmserve serve`, drives it from 2
client processes (closed loop pcm and mp3, WebSocket conversations with a stored voice, a burst, users spread over
2 random LoRA adapters over HTTP and the WebSocket) and writes a report whose numbers are present and sane."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_serve_bench_end_to_end(tmp_path):
    out = tmp_path / "serve"
    cmd = [sys.executable, "-m", "csmserve", "bench", "--serve", "--model", "dummy-tiny", "--device", "cpu",
           "--max-slots", "8", "--client-procs", "2", "--users", "4", "--ramp", "0.3", "--warmup", "1",
           "--duration", "2", "--audio-ms", "480", "--drain", "20", "--out", str(out),
           "--scenario", "closed", "--scenario", "closed:format=mp3", "--scenario", "ws:voices=1",
           "--scenario", "burst:within=0.3", "--scenario", "closed:adapters=2", "--scenario", "ws:adapters=2",
           "--lora-rank", "4", "--trace"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.monotonic()
    # --warmup 1: the first scenario's window opens after the fresh server's first (cold) requests, so it counts
    # requests that end in it even on a loaded 2-core CPU (with 0.3 s, none did once in a stress run: 0 requests/s)
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    assert time.monotonic() - t < 120
    report = json.loads(out.with_suffix(".json").read_text())
    names = [s["name"] for s in report["scenarios"]]
    assert names == ["closed 4 pcm", "closed 4 mp3", "ws 4 ws 1v", "burst 4 pcm in 0.3s", "closed 4 pcm 2a",
                     "ws 4 ws 2a"]
    for s in report["scenarios"]:
        req, ttfa = s["requests"], s["ttfa_ms"]
        assert req["ok"] > 0 and req["cut"] == 0 and s["errors"] == {}, s
        assert req["per_s"] > 0 and 0 < ttfa["p50"] <= ttfa["p99"] < 30_000, s
        assert s["dry"]["of"] == req["ok"] and 0 <= s["dry"]["300ms"] <= s["dry"]["100ms"] <= req["ok"]
        assert s["audio_rate"]["p50"] > 0 and 0.08 <= s["audio_s_mean"] <= 0.48 + 0.1, s  # + codec padding (mp3)
        assert s["server"]["ttfa_count"] > 0 and s["server"]["ttfa_p50_ms"] > 0, s
        assert s["clients"]["procs"] == 2 and s["clients"]["user_errors"] == []
    assert report["scenarios"][3]["requests"]["counted"] == 4  # a burst counts every arrival
    cpu = report["scenarios"][0]["server"]["cpu"]  # the server tree's CPU over the window, by process kind
    assert cpu["engine"] > 0 and cpu["workers_n"] >= 1 and cpu["workers"] > 0, cpu
    assert cpu["worker_min"] <= cpu["worker_max"] <= cpu["workers"], cpu
    md = out.with_suffix(".md").read_text()
    assert "| scenario | requests/s | TTFA p50 / p99 (ms)" in md and "| ws 4 ws 1v |" in md
    assert "TTFA p50 / p99" in p.stdout
    # --trace: the server traced into OUT.trace, each scenario's window joined (bench/trace_report.py)
    roles = sorted(f.name.split("-")[0] for f in out.with_suffix(".trace").iterdir())
    assert roles[0] == "engine" and roles[1:] and set(roles[1:]) == {"worker"}, roles
    traces = out.with_suffix(".trace.txt").read_text()
    assert traces.count("TTFA (received -> written)") == 6 and "### trace: closed 4 pcm" in md, traces
    # the adapters' scenarios: the requests named the 2 adapters (the server's per-adapter counters); the others none
    assert "--lora-dir" in " ".join(report["meta"]["server_args"])
    for s in report["scenarios"]:
        lora = s["server"]["lora_requests"]
        assert set(lora) == ({"bench-lora-0", "bench-lora-1"} if s["name"].endswith("2a") else set()), (s["name"], lora)
