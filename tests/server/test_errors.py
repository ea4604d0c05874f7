"""Every error: status and OpenAI's body shape; the server keeps serving after each."""
import base64
import threading
import time

import httpx
import openai
import pytest

from server_helpers import error_of, wait_slots_free, wav_bytes

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello.", "response_format": "pcm",
          "max_audio_length_ms": 160}


def post(server, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60, **kw)


def still_serving(server) -> None:
    r = post(server, SPEECH)
    assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("patch, param, code", [
    ({"input": ""}, "input", "empty_input"),
    ({"input": "   "}, "input", "empty_input"),
    ({"input": "x" * 4097}, "input", "input_too_long"),
    ({"response_format": "ogg"}, "response_format", "invalid_value"),
    ({"speed": 5.0}, "speed", "invalid_value"),
    ({"stream_format": "chunks"}, "stream_format", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"top_k": "many"}, "top_k", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"speaker": "zero"}, "speaker", "invalid_value"),
    ({"input": 42}, "input", "invalid_value"),
    ({"voice": 7}, "voice", "invalid_value"),
    ({"max_audio_length_ms": 10**7}, "max_audio_length_ms", "invalid_value"),
    ({"context": "not a list"}, "context", "invalid_value"),
    ({"context": [{"speaker": 0, "text": "x", "audio": "!!!not base64!!!"}]}, "context[0].audio", "invalid_base64"),
    ({"context": [{"speaker": 0, "text": "x", "audio": b64(b"this is not audio" * 100)}]}, "context[0].audio",
     "invalid_audio"),
    ({"context": [{"speaker": 0, "text": "x", "audio": b64(wav_bytes(0.5)), "voice_id": "v"}]}, "context[0]",
     "invalid_value"),
    ({"context": [{"speaker": 0, "text": "x"}] * 17}, "context", "context_too_long"),
    # prompt + audio > the model's positions (one unsplittable word: long multi-sentence input is long-form)
    ({"input": "w" * 3000}, "context", "context_too_long"),
])
def test_400(server, patch, param, code):
    r = post(server, {**SPEECH, **patch})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code, err


def test_400_missing_fields_and_bad_json(server):
    for field in ("model", "input", "voice"):
        body = {k: v for k, v in SPEECH.items() if k != field}
        err = error_of(post(server, body))
        assert (err["param"], err["code"]) == (field, "missing_required_parameter")
    r = post(server, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    still_serving(server)


def test_unknown_fields_are_ignored(server):
    assert post(server, {**SPEECH, "stream": True, "lang_code": "a", "whatever": {"x": 1}}).status_code == 200


def test_openai_client_sees_api_status_error(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        with c.audio.speech.with_streaming_response.create(model="tts-1", voice="nobody", input="hi"):
            pass
    assert e.value.body["code"] == "voice_not_found"  # the SDK unwraps {"error": ...}


def test_404(server):
    r = post(server, {**SPEECH, "voice": "no-such-voice"})
    assert r.status_code == 404 and error_of(r)["code"] == "voice_not_found" and error_of(r)["param"] == "voice"
    r = post(server, {**SPEECH, "voice": {"id": "voice_000"}})
    assert r.status_code == 404
    r = post(server, {**SPEECH, "context": [{"speaker": 1, "voice_id": "voice_nope"}]})
    assert r.status_code == 404 and error_of(r)["param"] == "context[0].voice_id"
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    still_serving(server)


def test_401(serve):
    server = serve(api_key="sekrit")
    r = post(server, SPEECH)
    assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert post(server, SPEECH, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert post(server, SPEECH, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # liveness stays open
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0)
    with c.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="ok",
                                                       extra_body={"max_audio_length_ms": 160}) as r:
        assert len(r.read()) > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_413_and_upload_errors(serve):
    server = serve(max_clip_seconds=2.0)
    big = b"\0" * (50 * 2**20)
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "big", "transcript": "x"},
                   files={"audio_sample": ("big.wav", big, "audio/wav")}, timeout=60)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    r = post(server, {**SPEECH, "context": [{"speaker": 0, "text": "x", "audio": b64(big)}]})
    assert r.status_code == 413

    def chunked():  # no Content-Length: the size is counted as the body arrives
        yield (b'--xyz\r\nContent-Disposition: form-data; name="audio_sample"; filename="a.wav"\r\n'
               b"Content-Type: audio/wav\r\n\r\n")
        for _ in range(50):
            yield b"\0" * 2**20
        yield b"\r\n--xyz--\r\n"

    r = httpx.post(f"{server.url}/v1/audio/voices", content=chunked(), timeout=60,
                   headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 413
    # one file over max_upload_bytes (10 MiB) inside a body under max_body_bytes (32 MiB)
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "n"},
                   files={"audio_sample": ("a.wav", b"\0" * (11 * 2**20), "audio/wav")}, timeout=60)
    assert r.status_code == 413 and error_of(r)["code"] == "file_too_large"
    for files, code in [((b"GIF89a not audio" * 1000), "invalid_audio"), (wav_bytes(3.0), "audio_too_long"),
                        (wav_bytes(0.05), "audio_too_short")]:
        r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "n", "transcript": "t"},
                       files={"audio_sample": ("a.wav", files, "audio/wav")}, timeout=60)
        assert r.status_code == 400 and error_of(r)["code"] == code, r.text
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": " "},
                   files={"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")})
    assert r.status_code == 400 and error_of(r)["param"] == "name"
    r = httpx.post(f"{server.url}/v1/audio/voices", files={"name": (None, "n")})  # multipart, no file part
    assert r.status_code == 400 and error_of(r)["param"] == "audio_sample"
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "n"})  # urlencoded: multipart only (issue 39)
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "n", "speaker": "x"},
                   files={"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")})
    assert r.status_code == 400 and error_of(r)["param"] == "speaker"
    still_serving(server)


def test_429_too_many_concurrent(serve, csm):
    server = serve(max_concurrent_requests=1)
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={**SPEECH, "max_audio_length_ms": 30000}) as held:
        assert held.status_code == 200
        body = held.iter_raw()  # keep the iterator: dropping it closes the connection
        next(body)  # it is generating
        r = post(server, SPEECH)
        assert r.status_code == 429
        err = error_of(r)
        assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests"
    wait_slots_free(csm)
    still_serving(server)


def test_503_engine_queue_full(serve, small_csm):
    server = serve(csm_=small_csm)  # 1 slot, 1 place in the queue
    sched = small_csm.client.engine.scheduler
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={**SPEECH, "max_audio_length_ms": 30000}) as held:
        assert held.status_code == 200
        body = held.iter_raw()
        next(body)
        queued = threading.Thread(target=post, args=(server, SPEECH))
        queued.start()
        deadline = time.time() + 10
        while sched.num_waiting < 1 and time.time() < deadline:
            time.sleep(0.01)
        r = post(server, SPEECH)
        assert r.status_code == 503 and error_of(r)["code"] == "server_busy"
    queued.join(30)
    wait_slots_free(small_csm)
    still_serving(server)


class FailingClient:
    """Yields the first chunk, then fails the way an engine step failure reaches astream."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def astream(self, request, **kw):
        agen = self.inner.astream(request, **kw)
        try:
            async for chunk in agen:
                yield chunk
                if len(chunk.codes):
                    raise RuntimeError("engine step failed: boom")
        finally:
            await agen.aclose()


class FailingCSM:
    def __init__(self, csm):
        self.csm, self.client = csm, FailingClient(csm.client)

    def __getattr__(self, name):
        return getattr(self.csm, name)


def test_error_after_streaming_began(serve, csm, caplog):
    server = serve(csm_=FailingCSM(csm))
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={**SPEECH, "stream_format": "sse", "max_audio_length_ms": 2000}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    import json

    events = [json.loads(line[6:]) for line in lines]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert "boom" in events[-1]["error"]["message"]
    with pytest.raises(httpx.RemoteProtocolError):  # audio mode: the body ends without its last chunk
        with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                          json={**SPEECH, "max_audio_length_ms": 2000}) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                pass
    assert any("failed after streaming began" in rec.message for rec in caplog.records)
    assert wait_slots_free(csm) == csm.client.stats().max_slots
    normal = serve()
    still_serving(normal)


# ---- what operators read: the guard's answers, the WebSocket key, the schema, the counts of refusals
def _app_server(tmp_path, **kw):
    from server_helpers import Server

    from csmserve.config import ServerConfig
    from csmserve.server import create_app

    worker = kw.pop("worker", None)
    return Server(create_app(None, ServerConfig(voices_db=str(tmp_path / "v.db"), **kw), worker=worker)).start()


def test_the_guard_s_own_refusals_say_which_worker(tmp_path):
    """401 and 413 answered by the guard carry x-csmserve-worker, as every other response does."""
    import socket

    server = _app_server(tmp_path, api_key="secret", worker=3)
    try:
        assert httpx.get(f"{server.url}/v1/models").headers.get("x-csmserve-worker") == "3"  # 401
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 999999999999\r\n\r\n")
        s.settimeout(5)
        head = s.recv(65536).split(b"\r\n\r\n")[0].decode().lower()
        s.close()
        assert head.startswith("http/1.1 413") and "x-csmserve-worker: 3" in head, head
    finally:
        server.stop()


def test_the_websocket_s_query_key_is_compared_in_constant_time(tmp_path, monkeypatch):
    import hmac

    from starlette.testclient import TestClient

    from csmserve.config import ServerConfig
    from csmserve.server import create_app

    seen, real = [], hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: seen.append(b) or real(a, b))
    app = create_app(None, ServerConfig(api_key="secret-key", voices_db=str(tmp_path / "v.db")))
    with TestClient(app) as c, c.websocket_connect("/v1/audio/speech/stream?api_key=wrong") as ws:
        assert ws.receive_json()["error"]["code"] == "invalid_api_key"
    assert b"secret-key" in seen


def test_openapi_states_the_bounds_clients_read(tmp_path):
    """Optional integers' bounds are JSON Schema's minimum / maximum (pydantic's own ge / le are ignored by
    generated clients and schemathesis); /metrics is text, not JSON."""
    from csmserve.config import ServerConfig
    from csmserve.server import create_app

    doc = create_app(None, ServerConfig(voices_db=str(tmp_path / "v.db"))).openapi()
    speaker = doc["components"]["schemas"]["SpeechRequest"]["properties"]["speaker"]["anyOf"][0]
    assert (speaker.get("minimum"), speaker.get("maximum")) == (0, 255) and "ge" not in speaker

    def keys(node, path=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield path, k
                yield from keys(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from keys(v, f"{path}[{i}]")

    assert not [f"{p}.{k}" for p, k in keys(doc["components"]["schemas"]) if k in ("ge", "le", "gt", "lt")]
    assert "application/json" not in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_a_request_the_engine_refuses_is_no_finished_generation(serve, small_csm):
    """A 503 server_busy (the engine's queue full) adds to request_errors, not to request_success_total or the
    end-to-end latency (whose fast refusals would make an overloaded server look quick)."""
    def counts():  # every label's sample summed; 0 where the series has none yet
        text = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
        return [sum(float(ln.rsplit(" ", 1)[1]) for ln in text if ln.startswith(name)) for name in
                ("csmserve:e2e_request_latency_seconds_count", "csmserve:request_success_total")]

    server = serve(csm_=small_csm)  # 1 slot, 1 place in the queue
    before = counts()
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60,
                      json={**SPEECH, "max_audio_length_ms": 30000}) as held:
        body = held.iter_raw()
        next(body)
        queued = threading.Thread(target=post, args=(server, SPEECH))
        queued.start()
        deadline = time.monotonic() + 30
        while small_csm.client.engine.scheduler.num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = post(server, SPEECH)
        assert refused.status_code == 503 and error_of(refused)["code"] == "server_busy"
        assert counts() == before
    queued.join(60)
    wait_slots_free(small_csm)
