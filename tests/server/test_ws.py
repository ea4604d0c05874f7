"""WebSocket /v1/audio/speech/stream (protocol: docs/api.md)."""
import base64
import json
import time

import httpx
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from server_helpers import wait_idle, wav_bytes

FRAME_BYTES = 1920 * 2


def ws_url(server, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream" + query


def recv_json(ws) -> dict:
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str):
            return json.loads(msg)


def turn(ws, until: str = "flush_done") -> tuple[bytes, list[dict]]:
    """Read messages until `until`; -> (audio bytes, the JSON messages)."""
    audio, msgs = b"", []
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, bytes):
            audio += msg
            continue
        m = json.loads(msg)
        msgs.append(m)
        if m["type"] == "audio":
            audio += base64.b64decode(m["audio"])
        if m["type"] in (until, "error"):
            return audio, msgs


def audio_rows(server) -> int:
    tokens, mask = server.state.last_prompt
    return int(mask[:, :32].any(axis=1).sum())


@pytest.mark.inproc
def test_text_pieces_flush_and_continuation(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "c1", "text": "Hello ", "voice": "alloy", "max_audio_length_ms": 400,
                            "seed": 3}))
        ws.send(json.dumps({"context_id": "c1", "text": "there.", "flush": True}))
        audio, msgs = turn(ws)
        done = msgs[-1]
        assert done["type"] == "flush_done" and done["context_id"] == "c1" and done["finish_reason"] == "length"
        chunks = [m for m in msgs if m["type"] == "audio"]
        assert sum(m["num_frames"] for m in chunks) == done["num_frames"] == 5
        assert [m["frame_start"] for m in chunks] == sorted(m["frame_start"] for m in chunks)
        assert len(audio) == done["num_frames"] * FRAME_BYTES
        tokens1, _ = server.state.last_prompt
        assert audio_rows(server) == 0  # alias voice, no history yet
        assert b"Hello there." in bytes(tokens1[:, 32].astype(np.uint8))

        # second turn: the first turn (its text and its 5 generated frames + EOS) is now context
        ws.send(json.dumps({"context_id": "c1", "text": "And more.", "flush": True}))
        audio2, msgs2 = turn(ws)
        assert msgs2[-1]["type"] == "flush_done" and len(audio2) == msgs2[-1]["num_frames"] * FRAME_BYTES
        tokens2, _ = server.state.last_prompt
        assert audio_rows(server) == 5 + 1
        assert b"Hello there." in bytes(tokens2[:, 32].astype(np.uint8))

        # close: the rest of the buffer, then done; the context is forgotten
        ws.send(json.dumps({"context_id": "c1", "text": "Bye.", "close": True}))
        _, msgs3 = turn(ws, until="done")
        assert [m["type"] for m in msgs3 if m["type"] != "audio"] == ["flush_done", "done"]
        assert audio_rows(server) == 2 * (5 + 1)
        ws.send(json.dumps({"context_id": "c1", "text": "Fresh.", "flush": True, "max_audio_length_ms": 160}))
        turn(ws)
        assert audio_rows(server) == 0


@pytest.mark.inproc
def test_stored_voice_and_binary_frames_f32(server):
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "wsvoice", "transcript": "Reference."},
                   files={"audio_sample": ("a.wav", wav_bytes(0.5), "audio/wav")}, timeout=60)
    v = r.json()
    with connect(ws_url(server, "?binary=1")) as ws:
        ws.send(json.dumps({"context_id": "b", "text": "Binary please.", "voice": v["id"], "flush": True,
                            "output_format": "pcm_f32le", "max_audio_length_ms": 240}))
        audio, msgs = turn(ws)
        assert [m["type"] for m in msgs] == ["flush_done"]
        assert len(audio) == msgs[-1]["num_frames"] * 1920 * 4
        assert np.isfinite(np.frombuffer(audio, "<f4")).all()
        assert audio_rows(server) == v["num_frames"] + 1  # the voice's clip conditions the prompt


def test_cancel_frees_the_slot_and_connection_goes_on(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "long", "text": "A very long answer.", "flush": True,
                            "max_audio_length_ms": 30000}))
        m = recv_json(ws)
        assert m["type"] == "audio"
        ws.send(json.dumps({"context_id": "long", "cancel": True}))
        _, msgs = turn(ws, until="cancelled")
        assert msgs[-1] == {"type": "cancelled", "context_id": "long"}
        assert wait_idle(server)
        ws.send(json.dumps({"context_id": "next", "text": "Short.", "flush": True, "max_audio_length_ms": 160}))
        audio, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done" and len(audio) == 2 * FRAME_BYTES


def test_disconnect_mid_generation_frees_the_slot(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "x", "text": "Talk for a while.", "flush": True,
                            "max_audio_length_ms": 30000}))
        assert recv_json(ws)["type"] == "audio"
    t = time.time()
    assert wait_idle(server)
    assert time.time() - t < 5


def test_errors_keep_the_connection(server):
    with connect(ws_url(server)) as ws:
        ws.send("{not json")
        m = recv_json(ws)
        assert m["type"] == "error" and m["error"]["code"] == "invalid_json"
        assert set(m["error"]) == {"message", "type", "param", "code"}
        ws.send(json.dumps({"context_id": "e", "temperature": "hot"}))
        m = recv_json(ws)
        assert m["error"]["param"] == "temperature" and m["context_id"] == "e"
        ws.send(json.dumps({"context_id": "e", "text": "Hi.", "voice": "nobody", "flush": True}))
        m = recv_json(ws)
        assert m["error"]["code"] == "voice_not_found" and m["context_id"] == "e"
        ws.send(json.dumps({"context_id": "e", "text": "x" * 5000}))
        assert recv_json(ws)["error"]["code"] == "input_too_long"
        ws.send(json.dumps({"context_id": "ok", "text": "Fine.", "flush": True, "max_audio_length_ms": 160}))
        audio, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done" and len(audio) == 2 * FRAME_BYTES


def test_api_key(serve):
    server = serve(api_key="k")
    with connect(ws_url(server)) as ws:
        m = recv_json(ws)
        assert m["type"] == "error" and m["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd.code == 1008
    for kw in ({"additional_headers": {"Authorization": "Bearer k"}}, {}):
        url = ws_url(server, "" if kw else "?api_key=k")
        with connect(url, **kw) as ws:
            ws.send(json.dumps({"text": "Authorized.", "flush": True, "max_audio_length_ms": 160}))
            assert turn(ws)[1][-1]["type"] == "flush_done"


def test_a_websocket_that_never_answers_a_ping_is_closed_after_the_ping_timeout(serve):
    """--ws-ping-interval-s / --ws-ping-timeout-s: a peer that reads nothing (gone without a FIN, a frozen client)
    is closed once a ping's pong is that late, its session and slot freed; before, uvicorn's 20 s + 20 s always."""
    import base64
    import os
    import socket
    import time

    server = serve(ws_ping_interval_s=0.3, ws_ping_timeout_s=0.3)
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(f"GET /v1/audio/speech/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    t0 = time.monotonic()
    s.settimeout(10)
    data = b""
    while chunk := s.recv(4096):  # the upgrade, pings (never answered), then the close and EOF
        data += chunk
    s.close()
    assert data.startswith(b"HTTP/1.1 101") and time.monotonic() - t0 < 5
