"""`csmserve serve --model paced`: the stand-in engine (engine/paced.py) behind the real server's processes,
as the CPU load benchmark runs it (bench/serve_bench.py --model paced): speech in every way a client takes it, a stored voice,
requests that stop at their length, the time a 1 s request takes no shorter than the GPU's 12 frame steps."""
from __future__ import annotations

import base64
import json
import time

import httpx
import pytest

from server_helpers import ProcServer, wav_bytes
from test_ws import turn
from websockets.sync.client import connect


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    server = ProcServer(tmp_path_factory.mktemp("paced"), workers=1, model="paced").start()
    yield server
    server.stop()


def test_pcm_and_mp3_stop_at_their_length(paced):
    body = {"model": "tts-1", "voice": "alloy", "input": "Hello from the paced engine.", "max_audio_length_ms": 1000}
    t = time.perf_counter()
    r = httpx.post(f"{paced.url}/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=60)
    assert r.status_code == 200 and len(r.content) == 12 * 1920 * 2  # 1,000 ms: 12 whole frames
    assert time.perf_counter() - t >= 12 * 4.6e-3  # 12 frame steps at the H200's batch-1 time at least
    mp3 = httpx.post(f"{paced.url}/v1/audio/speech", json={**body, "response_format": "mp3"}, timeout=60)
    assert mp3.status_code == 200 and r.headers["content-type"].startswith("audio/pcm") and len(mp3.content) > 1000
    assert mp3.headers["content-type"] == "audio/mpeg"


def test_sse_timestamps_and_a_stored_voice(paced):
    v = httpx.post(f"{paced.url}/v1/audio/voices", timeout=60, files={"audio_sample": ("v.wav", wav_bytes(1.0), "audio/wav")},
                   data={"name": "paced", "transcript": "A test voice."})
    assert v.status_code in (200, 201), v.text
    body = {"model": "tts-1", "voice": v.json()["id"], "input": "One sentence. And another one.",
            "response_format": "pcm", "stream_format": "sse", "add_timestamps": True, "max_audio_length_ms": 2000,
            "max_segment_length_ms": 640}
    with httpx.stream("POST", f"{paced.url}/v1/audio/speech", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    spans = [e for e in events if e["type"] == "speech.audio.segment"]
    assert [(s["audio_start_ms"], s["audio_end_ms"], s["finish_reason"]) for s in spans] == [
        (0, 640, "length"), (640, 1280, "length")]  # each sentence to its cap: 8 frames
    assert len(audio) == 16 * 1920 * 2 and events[-1]["usage"]["output_tokens"] == 16


def test_a_websocket_turn(paced):
    with connect(paced.url.replace("http", "ws") + "/v1/audio/speech/stream", open_timeout=30) as ws:
        ws.send(json.dumps({"context_id": "c1", "text": "Hi there.", "voice": "alloy", "max_audio_length_ms": 800,
                            "flush": True}))
        audio, msgs = turn(ws)
    assert msgs[-1]["type"] == "flush_done" and msgs[-1]["finish_reason"] == "length"
    frames = [m["num_frames"] for m in msgs if m["type"] == "audio"]
    assert sum(frames) == 10 and frames[0] == 1
    assert [m["frame_start"] for m in msgs if m["type"] == "audio"] == [sum(frames[:i]) for i in range(len(frames))]
    assert len(audio) == 10 * 1920 * 2
