"""Issue 13: what a client sends cannot take the server down. One test per defect found by probing
(each failed before its fix); the table of hostile inputs is test_hostile.py, the schema fuzzing
test_schema_fuzz.py. Limits and timeouts: docs/reliability.md."""
import base64
import http.client
import json
import socket
import threading
import time

import httpx
from websockets.sync.client import connect

from server_helpers import SHORT_MS, error_of, raw_wav, wait_slots_free, wav_bytes

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm",
          "max_audio_length_ms": 400}
FRAME_BYTES = 1920 * 2


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def recv_json(ws, timeout: float = 60) -> dict:
    while True:
        msg = ws.recv(timeout=timeout)
        if isinstance(msg, str):
            return json.loads(msg)


def until(ws, kind: str, timeout: float = 60) -> list[dict]:
    out = []
    while True:
        out.append(recv_json(ws, timeout))
        if out[-1]["type"] in (kind, "error"):
            return out


def running(server) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("csmserve:num_requests_running{"):
            return float(line.split()[-1])
    raise AssertionError("no running gauge")


def same_audio(a: bytes, b: bytes) -> bool:
    """The same frames: equal length, PCM within a few LSB (Mimi's GEMMs round differently at another batch size)."""
    import numpy as np

    x, y = np.frombuffer(a, "<i2").astype(int), np.frombuffer(b, "<i2").astype(int)
    return len(x) == len(y) and int(np.abs(x - y).max(initial=0)) <= 8


# ---- 0: a tiny temperature ends only itself (it did: index -1 in the sampler, every stream failed)
def test_tiny_temperature_beside_a_seeded_stream(server):
    seeded = {**SPEECH, "seed": 11, "temperature": 0.9, "max_audio_length_ms": 2000}
    alone = httpx.post(f"{server.url}/v1/audio/speech", json=seeded, timeout=60).content
    assert len(alone) == 25 * FRAME_BYTES
    greedy = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "temperature": 0}, timeout=60).content
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=seeded, timeout=60) as held:
        body = held.iter_raw()
        got = next(body)  # generating
        for t in (1.175494351e-38, 1e-30, 5e-38):
            r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "temperature": t, "top_p": 1e-30},
                           timeout=60)
            assert r.status_code == 200 and same_audio(r.content, greedy)  # the limit t -> 0 is greedy
        for part in body:
            got += part
    assert same_audio(got, alone)  # the seeded stream beside them: every frame, unchanged


# ---- 1: 8+ channel audio (SIGSEGV in PyAV) as a voice, as context, over the WebSocket
def test_many_channel_audio_everywhere(server):
    for ch in (8, 9, 16):
        wav = raw_wav(channels=ch, rate=24_000, samples=24_000)
        r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": f"ch{ch}", "transcript": "A tone."},
                       files={"audio_sample": ("a.wav", wav, "audio/wav")}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["num_frames"] == 12 + 1 or r.json()["num_frames"] >= 12  # 1 s of 80 ms frames
        ctx = [{"speaker": 1, "text": "Before.", "audio": base64.b64encode(wav).decode()}]
        r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "context": ctx}, timeout=60)
        assert r.status_code == 200 and len(r.content) == 5 * FRAME_BYTES
        with connect(ws_url(server)) as ws:
            ws.send(json.dumps({"context_id": "mc", "add_context": ctx, "text": "After.", "flush": True,
                                "max_audio_length_ms": 160}))
            assert until(ws, "flush_done")[-1]["type"] == "flush_done"
    voices = httpx.get(f"{server.url}/v1/audio/voices").json()["data"]
    assert {"ch8", "ch9", "ch16"} <= {v["name"] for v in voices}


def test_nan_wav_is_not_a_voice(server):
    import numpy as np

    for data in (np.full((24_000, 1), np.nan), np.full((24_000, 2), np.inf)):
        wav = raw_wav(channels=data.shape[1], bits=32, float_=True, data=data)
        r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "nan", "transcript": "x"},
                       files={"audio_sample": ("a.wav", wav, "audio/wav")}, timeout=60)
        assert r.status_code == 400 and error_of(r)["code"] == "invalid_audio", r.text
    assert "nan" not in {v["name"] for v in httpx.get(f"{server.url}/v1/audio/voices").json()["data"]}


# ---- 2: 16 turns of 1 MB context text (23.6 s of a blocked event loop, 9.7 GB): a fast 400
def test_huge_context_text_is_refused_fast_and_health_stays_responsive(server):
    body = {**SPEECH, "context": [{"speaker": 0, "text": "word " * 200_000}] * 16}  # 16 MB, under max_body_bytes
    latencies, stop = [], threading.Event()

    def probe():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get(f"{server.url}/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.1)
        t = time.perf_counter()
        r = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
        took = time.perf_counter() - t
        time.sleep(0.1)
    finally:
        stop.set()
        prober.join()
    err = error_of(r)
    assert r.status_code == 400 and (err["code"], err["param"]) == ("context_too_long", "context[0].text")
    assert took < 5.0, took  # it was 23.6 s
    assert len(latencies) >= 5 and max(latencies) < 2.0, max(latencies)  # /health never waited on it
    # each turn under the cap, their sum over max_context_total_chars (16384)
    r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "context": [{"text": "w " * 2000}] * 5},
                   timeout=60)
    assert r.status_code == 400 and (error_of(r)["code"], error_of(r)["param"]) == ("context_too_long", "context")
    assert httpx.post(f"{server.url}/v1/audio/speech", json=SPEECH, timeout=60).status_code == 200


def test_context_text_caps_are_flags(serve):
    server = serve(max_context_chars=10, max_context_total_chars=15)
    for ctx, param in ([{"text": "x" * 11}], "context[0].text"), ([{"text": "x" * 8}] * 2, "context"):
        r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "context": ctx}, timeout=60)
        assert r.status_code == 400 and error_of(r)["param"] == param
        with connect(ws_url(server)) as ws:  # the WebSocket's context / add_context: the same caps
            ws.send(json.dumps({"context_id": "c", "add_context": ctx}))
            m = recv_json(ws)
            assert m["type"] == "error" and m["error"]["code"] == "context_too_long"
            assert m["error"]["param"] == param.replace("context", "add_context")
    assert httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "context": [{"text": "x" * 7}] * 2},
                      timeout=60).status_code == 200


# ---- 3: a binary frame, 100,000-deep JSON, an oversized message: an error each, the connection and session live
def test_websocket_survives_binary_deep_and_huge_messages(serve):
    server = serve(max_ws_message_bytes=1 << 20)
    with connect(ws_url(server), max_size=None) as ws:
        ws.send(json.dumps({"context_id": "s", "text": "Hello there. And", "max_audio_length_ms": 240}))
        ws.send(b"\x00\x01binary")  # mid-turn
        m = recv_json(ws)
        while m["type"] == "audio":
            m = recv_json(ws)
        assert m["type"] == "error" and m["error"]["code"] == "invalid_message"
        ws.send('{"context_id": "s", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
        ws.send("[" * 100_000)  # not even closed
        ws.send(json.dumps({"context_id": "s", "text": "x" * ((1 << 20) + 1)}))
        # the limit is in bytes: half as many characters, each two bytes of UTF-8
        ws.send(json.dumps({"context_id": "s", "text": "\u00e9" * ((1 << 19) + 1)}, ensure_ascii=False))
        codes = []
        while len(codes) < 4:
            m = recv_json(ws)
            if m["type"] == "error":
                codes.append((m["error"]["code"], m["context_id"]))
        assert codes == [("invalid_json", "s"), ("invalid_json", None)] + [("message_too_large", "s")] * 2
        assert all(set(m["error"]) == {"message", "type", "param", "code"} for m in [m])
        ws.send(json.dumps({"context_id": "s", "text": " then more.", "flush": True}))
        msgs = until(ws, "flush_done")
        assert msgs[-1]["type"] == "flush_done" and msgs[-1]["num_segments"] == 2  # the turn was not cancelled
        ws.send(json.dumps({"context_id": "s", "text": "Second turn.", "flush": True}))
        assert until(ws, "flush_done")[-1]["type"] == "flush_done"
        if server.state is not None:
            assert [t.role for t in server.state.sessions.get("s").turns] == ["assistant", "assistant"]


# ---- 7: slow clients: headers or a body a byte at a time; an idle WebSocket turn
def _dribble(port: int, data: bytes, every: float, limit: float) -> tuple[bytes, float]:
    """Send `data` a byte per `every` seconds; -> (what the server answered, seconds until it closed)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(every)
    t, answer = time.perf_counter(), b""
    try:
        for i in range(len(data)):
            try:
                s.send(data[i:i + 1])
            except OSError:
                break
            try:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
            except socket.timeout:
                pass
            if time.perf_counter() - t > limit:
                break
        s.settimeout(limit)
        while chunk := s.recv(65536):
            answer += chunk
    except OSError:
        pass
    finally:
        s.close()
    return answer, time.perf_counter() - t


def test_slow_headers_and_slow_body_get_408(serve):
    server = serve(header_timeout_s=1.0, body_timeout_s=1.0, body_min_rate=1_000_000)
    results = {}

    def slow_headers():
        results["headers"] = _dribble(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200, 0.1, 8)

    def slow_body():
        body = json.dumps(SPEECH).encode()
        head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(head)
        answer, took = b"", 0.0
        s.settimeout(0.1)
        t = time.perf_counter()
        for i in range(len(body)):
            try:
                s.send(body[i:i + 1])
                answer += s.recv(65536)
                break
            except socket.timeout:
                pass
            except OSError:
                break
        s.settimeout(8)
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
        took = time.perf_counter() - t
        s.close()
        results["body"] = (answer, took)

    threads = [threading.Thread(target=slow_headers), threading.Thread(target=slow_body)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    t = time.perf_counter()
    assert httpx.post(f"{server.url}/v1/audio/speech", json=SPEECH, timeout=30).status_code == 200  # others: served
    assert time.perf_counter() - t < 5
    for th in threads:
        th.join(30)
    for name in ("headers", "body"):
        answer, took = results[name]
        assert answer.startswith(b"HTTP/1.1 408"), (name, answer[:200])
        err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error", err
        assert 0.9 < took < 5, (name, took)  # closed at the deadline, not held
    assert 'status="408"' in httpx.get(f"{server.url}/metrics").text  # the body's (the headers' is below the app)


def test_a_body_at_the_minimum_rate_is_not_cut(serve):
    server = serve(body_timeout_s=0.5, body_min_rate=2_000)

    def chunks():  # 8 KB at ~8 KB/s: past body_timeout_s, inside its extension (1 s per 2 KB)
        body = json.dumps({**SPEECH, "pad": "x" * 8000}).encode()  # an unknown field: ignored
        for i in range(0, len(body), 1024):
            time.sleep(0.12)
            yield body[i:i + 1024]

    r = httpx.post(f"{server.url}/v1/audio/speech", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200, r.text


def test_idle_websocket_turn_is_flushed_and_its_slot_freed(serve, csm):
    server = serve(ws_turn_idle_s=3.0)
    sched = csm.client.engine.scheduler
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "idle", "text": "Hello there. And then", "max_segment_length_ms": 400,
                            "max_audio_length_ms": 5000}))
        t0 = time.perf_counter()
        frames = 0
        while frames < 5:  # the first sentence, spoken; the open request then idles in its slot
            m = recv_json(ws)
            assert m["type"] == "audio", m
            frames += m["num_frames"]
        time.sleep(0.2)
        assert sched.num_free_slots == sched.max_slots - 1
        assert running(server) == 1.0  # an idle request holds a slot: it is counted
        msgs = until(ws, "flush_done", timeout=30)
        done = msgs[-1]
        assert done["type"] == "flush_done" and done["idle_timeout"] is True and done["num_segments"] == 2
        assert 2.5 < time.perf_counter() - t0 < 15
        assert sum(m["num_frames"] for m in msgs if m["type"] == "audio") == 5  # "And then", spoken
        assert wait_slots_free(csm) == sched.max_slots and running(server) == 0.0
        ws.send(json.dumps({"context_id": "idle", "text": "Still here.", "flush": True, "max_audio_length_ms": 160}))
        assert until(ws, "flush_done")[-1].get("idle_timeout") is None  # a client flush: no flag


# ---- 8: the schema, null codes, probes in the error counts
def test_openapi_documents_what_the_server_answers(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    ops = [(path, method, op) for path, item in doc["paths"].items() for method, op in item.items()]
    assert len(ops) >= 10
    for path, method, op in ops:
        assert "422" not in op["responses"], (path, method)
        assert op["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    speech = doc["paths"]["/v1/audio/speech"]["post"]
    assert set(speech["responses"]["200"]["content"]) == {"audio/mpeg", "audio/ogg; codecs=opus", "audio/aac",
                                                         "audio/flac", "audio/wav", "audio/pcm", "text/event-stream"}
    body = speech["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"] == "#/components/schemas/SpeechRequest"
    assert "400" in speech["responses"] and "HTTPValidationError" not in doc["components"]["schemas"]
    assert {"SpeechRequest", "ContextTurn", "VoiceRef", "ErrorResponse"} <= set(doc["components"]["schemas"])


def test_every_error_has_a_code(server):
    cases = [
        httpx.post(f"{server.url}/v1/audio/speech", content=b"", headers={"content-type": "application/json"}),
        httpx.post(f"{server.url}/v1/audio/speech", content=b"null", headers={"content-type": "application/json"}),
        httpx.post(f"{server.url}/v1/audio/voices", content=b"garbage",
                   headers={"content-type": "multipart/form-data"}),
        httpx.post(f"{server.url}/v1/audio/voices", content=b"garbage",
                   headers={"content-type": "multipart/form-data; boundary=x"}),
        httpx.post(f"{server.url}/v1/audio/voices"),
        httpx.put(f"{server.url}/v1/audio/speech"),
    ]
    for r in cases:
        err = error_of(r)
        assert r.status_code in (400, 405, 415) and err["code"], (r.status_code, err)
    empty = error_of(cases[0])
    assert (empty["code"], empty["param"]) == ("missing_required_parameter", "model")
    assert error_of(cases[1])["code"] == "invalid_json"
    assert error_of(cases[2])["code"] == error_of(cases[3])["code"] == "invalid_multipart"


def test_ready_503_while_loading_is_not_a_request_error(csm, tmp_path):
    from csmserve.config import ServerConfig
    from csmserve.server import create_app
    from server_helpers import Server

    gate = threading.Event()
    server = Server(create_app(None, ServerConfig(voices_db=str(tmp_path / "v.db"), default_audio_length_ms=SHORT_MS),
                               load=lambda: gate.wait(30) and csm)).start()
    try:
        for _ in range(5):
            assert httpx.get(f"{server.url}/ready").status_code == 503
        r = httpx.post(f"{server.url}/v1/audio/speech", json=SPEECH)
        assert r.status_code == 503  # a refused request is an error: counted
        text = httpx.get(f"{server.url}/metrics").text
        errors = [line for line in text.splitlines() if line.startswith("csmserve:request_errors_total{")]
        assert errors == ['csmserve:request_errors_total{model_name="sesame/csm-1b",status="503"} 1.0'], errors
    finally:
        gate.set()
        server.app.state.server.csm = None  # not ours to close
        server.stop()


def test_idle_keep_alive_connection_is_closed(serve):
    server = serve(keep_alive_s=0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = http.client.HTTPResponse(s)  # the whole answer, though headers and body may come in two reads
        answer.begin()
        assert answer.status == 200 and answer.read()
        t = time.perf_counter()
        assert s.recv(65536) == b""  # closed by the server, not by us
        assert 0.3 < time.perf_counter() - t < 5


def test_a_clip_the_engine_does_not_encode_in_time_is_503_server_busy(serve, monkeypatch):
    """RemoteEngineClient.encode's timeout (the engine process's encoder behind other clips): 503 server_busy, a
    retryable error, not a 500."""
    server = serve()

    def late(pcm):
        raise TimeoutError

    monkeypatch.setattr(server.state.csm, "encode_audio", late)
    r = httpx.post(f"{server.url}/v1/audio/voices", timeout=60, data={"name": "late", "transcript": "A clip."},
                   files={"audio_sample": ("ref.wav", wav_bytes(1.0), "audio/wav")})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
