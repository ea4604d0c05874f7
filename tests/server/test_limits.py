"""Issue 13 items 4-6: a client that leaves while queued frees its place at once; max_audio_length_ms
caps the whole response; a client that stops reading is dropped and its slot freed."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np

from server_helpers import metric, wait_idle

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"}


def _raw_post(port: int, body: dict, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def _wait(pred, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_request_closed_while_queued_leaves_the_queue_at_once(serve, small_csm):
    server = serve(csm_=small_csm)  # 1 slot, 1 place in the queue
    held = threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/audio/speech", timeout=120,
                                                      json={**SPEECH, "max_audio_length_ms": 20_000}))
    held.start()
    assert _wait(lambda: metric(server, "csmserve:num_requests_running") == 1, 30)
    queued = _raw_post(server.port, {**SPEECH, "max_audio_length_ms": 160})
    assert _wait(lambda: metric(server, "csmserve:num_requests_waiting") == 1, 10)
    frames = small_csm.client.stats().frames
    queued.close()  # the client leaves while its request waits for the slot
    assert _wait(lambda: metric(server, "csmserve:num_requests_waiting") == 0, 5)
    # the place is free: another request queues (not 503 server_busy), and runs once the slot frees
    r = {}
    t = threading.Thread(target=lambda: r.setdefault("r", httpx.post(f"{server.url}/v1/audio/speech", timeout=120,
                                                                      json={**SPEECH, "max_audio_length_ms": 160})))
    t.start()
    assert _wait(lambda: metric(server, "csmserve:num_requests_waiting") == 1, 10)
    held.join(120)
    t.join(120)
    assert r["r"].status_code == 200 and len(r["r"].content) == 2 * 1920 * 2
    # the closed one was never admitted: the frames made since are the held request's and the new one's
    assert wait_idle(server)
    made = small_csm.client.stats().frames - frames
    assert made <= 20_000 // 80 + 2, made


def test_max_audio_length_ms_caps_the_whole_response(server):
    body = {**SPEECH, "input": "Hi there. " * 20, "max_audio_length_ms": 800, "max_segment_length_ms": 400}
    r = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200
    frames = len(r.content) / (1920 * 2)
    assert frames == int(frames) and 0 < frames <= 800 // 80, frames  # 10 frames for all 20 sentences
    # and a WebSocket turn: the whole turn, every segment together
    from websockets.sync.client import connect

    from test_ws import turn, ws_url

    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "cap", "text": "Hi there. " * 20, "flush": True,
                            "max_audio_length_ms": 800, "max_segment_length_ms": 400}))
        audio, msgs = turn(ws)
        assert 0 < msgs[-1]["num_frames"] <= 10 and msgs[-1]["finish_reason"] == "length"


def test_random_weights_stop_at_a_readers_length_when_no_length_is_named(serve, csm):
    """Issue 39: dummy-tiny never ends a sentence (no EOS), so a request that names no length stops at
    --audio-ms-per-char x its characters (at least 1 s), not at the 30 s floor real weights keep."""
    import pytest

    from csmserve.config import ServerConfig

    if not getattr(csm, "random_weights", False):
        pytest.skip("the stand-in CSM (CSMSERVE_TEST_FAKE_CSM=1) has no random weights")
    assert (ServerConfig().audio_floor_ms(False), ServerConfig().audio_floor_ms(True)) == (30_000, 1000)
    assert ServerConfig(default_audio_length_ms=500).audio_floor_ms(True) == 500  # as set, on any weights
    server = serve(default_audio_length_ms=None)
    frames = lambda r: len(r.content) // (1920 * 2)  # noqa: E731
    r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "input": "Hello from csmserve."}, timeout=120)
    assert r.status_code == 200 and frames(r) == 20 * 150 // 80  # 20 characters: 3 s
    r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "input": "Hi."}, timeout=120)
    assert frames(r) == 1000 // 80  # at least 1 s
    # two sentences: each at most the longest one's reading length (25 characters), all at the text's (46)
    r = httpx.post(f"{server.url}/v1/audio/speech", timeout=120,
                   json={**SPEECH, "input": "Hello from csmserve. Any length of text works."})
    assert frames(r) == 46 * 150 // 80
    r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "input": "Hi.", "max_audio_length_ms": 2000},
                   timeout=120)
    assert frames(r) == 2000 // 80  # a length named is kept


def test_a_client_that_never_reads_is_dropped_and_its_slot_freed(serve):
    server = serve(max_reader_lag_s=1.5, sndbuf=4096)
    aborts = _aborted(server)
    s = _raw_post(server.port, {**SPEECH, "max_audio_length_ms": 30_000, "input": "Talk for a long time."},
                  rcvbuf=4096)
    assert _wait(lambda: metric(server, "csmserve:num_requests_running") == 1, 30)
    # generation runs far ahead of real time; the client reads nothing: once it is 1.5 s of audio behind
    # real time (and the socket buffers are full) the request is stopped and the slot freed
    assert _wait(lambda: metric(server, "csmserve:num_requests_running") == 0, 60)
    assert _wait(lambda: _aborted(server) == aborts + 1, 20)  # and its response ended (the write stalled)
    s.close()
    r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": 160}, timeout=60)
    assert r.status_code == 200 and np.frombuffer(r.content, "<i2").size == 2 * 1920


def _aborted(server) -> float:
    try:
        return metric(server, 'csmserve:request_success_total{finished_reason="abort"')
    except KeyError:
        return 0.0
