"""Hostile input, table-driven: each case sends one thing a careless or hostile client might, and asserts
the status, OpenAI's error shape (a non-null code) and that the server is still up (/health, the stored
voice); after each group a whole speech request in the stored voice and the voice list show it still
serves. Groups: speech JSON (types, sizes, numbers, unicode), raw speech bodies (encodings, JSON
oddities, content types), context audio (odd channels / rates / lengths, truncated, not audio), voice
uploads (multipart), routes, raw HTTP, the WebSocket."""
from __future__ import annotations

import base64
import json
import socket

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from csmserve.config import ServerConfig
from csmserve.server import create_app
from server_helpers import Server, error_of, raw_wav, wav_bytes

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello.", "response_format": "pcm", "max_audio_length_ms": 160}
FRAME_BYTES = 1920 * 2
CANARY = "hostile-canary"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def nan_wav(channels: int = 1, value: float = np.nan) -> bytes:
    return raw_wav(channels=channels, bits=32, float_=True, data=np.full((24_000, channels), value))


@pytest.fixture(scope="module")
def srv(csm, tmp_path_factory):
    server = Server(create_app(csm, ServerConfig(voices_db=str(tmp_path_factory.mktemp("hostile") / "v.db"),
                                                 default_audio_length_ms=160))).start()
    server.http = httpx.Client(base_url=server.url, timeout=60)  # one client: a new one per call costs ~70 ms
    r = server.http.post("/v1/audio/voices", data={"name": CANARY, "transcript": "A tone."},
                         files={"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")})
    assert r.status_code == 200, r.text
    server.canary = r.json()["id"]
    yield server
    server.http.close()
    server.stop()


def check(r: httpx.Response, status: int, code: str | None, param: object = ...) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    if status >= 400:
        err = error_of(r)
        assert isinstance(err["code"], str) and err["code"], err
        assert code is None or err["code"] == code, err
        assert param is ... or err["param"] == param, err


def alive(server) -> None:
    """Cheap, after every case: the process answers and the stored voice is there."""
    assert server.http.get("/health").status_code == 200
    assert server.http.get(f"/v1/audio/voices/{server.canary}").status_code == 200


def still_serves(server) -> None:
    """After each group: a whole generation in the stored voice, and the voice list."""
    r = server.http.post("/v1/audio/speech", json={**SPEECH, "voice": server.canary})
    assert r.status_code == 200 and len(r.content) == 2 * FRAME_BYTES
    assert CANARY in {v["name"] for v in server.http.get("/v1/audio/voices").json()["data"]}


# ---- speech JSON: (id, patch of a good body, status, code, param)
_ = ...
SPEECH_CASES = [
    ("input-null", {"input": None}, 400, "invalid_value", "input"),
    ("input-list", {"input": ["Hello."]}, 400, "invalid_value", "input"),
    ("input-object", {"input": {"text": "Hello."}}, 400, "invalid_value", "input"),
    ("input-bool", {"input": True}, 400, "invalid_value", "input"),
    ("input-number", {"input": 1e308}, 400, "invalid_value", "input"),
    ("voice-null", {"voice": None}, 400, "invalid_value", "voice"),
    ("voice-ref-int-id", {"voice": {"id": 5}}, 400, "invalid_value", _),
    ("voice-empty", {"voice": ""}, 404, "voice_not_found", "voice"),
    ("voice-100k-chars", {"voice": "v" * 100_000}, 404, "voice_not_found", "voice"),
    ("model-int", {"model": 1}, 400, "invalid_value", "model"),
    ("temperature-string-number", {"temperature": "0.5"}, 200, None, _),  # lax float, as OpenAI's SDKs send
    ("temperature-string-word", {"temperature": "hot"}, 400, "invalid_value", "temperature"),
    ("temperature-smallest-normal-f32", {"temperature": 1.175494351e-38}, 200, None, _),
    ("temperature-subnormal-f64", {"temperature": 5e-324}, 200, None, _),
    ("temperature-negative-zero", {"temperature": -0.0}, 200, None, _),
    ("temperature-above-2", {"temperature": 2.0000001}, 400, "invalid_value", "temperature"),
    ("temperature-negative", {"temperature": -1e-300}, 400, "invalid_value", "temperature"),
    ("top-p-zero", {"top_p": 0}, 400, "invalid_value", "top_p"),
    ("top-p-tiny", {"top_p": 1e-300}, 200, None, _),
    ("top-k-float-integral", {"top_k": 1.0}, 200, None, _),  # JSON Schema's integer
    ("top-k-float-fraction", {"top_k": 1.5}, 400, "invalid_value", "top_k"),
    ("top-k-2^64", {"top_k": 2**64}, 400, "invalid_value", "top_k"),
    ("top-k-negative", {"top_k": -1}, 400, "invalid_value", "top_k"),
    ("seed-2^63", {"seed": 2**63}, 400, "invalid_value", "seed"),
    ("seed-max", {"seed": 2**63 - 1}, 200, None, _),
    ("seed-4000-digits", {"seed": int("9" * 4000)}, 400, "invalid_value", "seed"),
    ("speaker-256", {"speaker": 256}, 400, "invalid_value", "speaker"),
    ("speaker-negative", {"speaker": -1}, 400, "invalid_value", "speaker"),
    ("length-79ms", {"max_audio_length_ms": 79}, 400, "invalid_value", "max_audio_length_ms"),
    ("length-2^70", {"max_audio_length_ms": 2**70}, 400, "invalid_value", "max_audio_length_ms"),
    ("length-one-frame", {"max_audio_length_ms": 80}, 200, None, _),
    ("speed-zero", {"speed": 0}, 400, "invalid_value", "speed"),
    ("speed-string", {"speed": "fast"}, 400, "invalid_value", "speed"),
    ("format-uppercase", {"response_format": "PCM"}, 400, "invalid_value", "response_format"),
    ("stream-format-null", {"stream_format": None}, 400, "invalid_value", "stream_format"),
    ("input-4097-accented", {"input": "é" * 4097}, 400, "input_too_long", "input"),
    ("input-10MB", {"input": "x" * (10 * 2**20)}, 400, "input_too_long", "input"),
    ("input-unicode-spaces-only", {"input": "\u2003\u3000\u00a0"}, 400, "empty_input", "input"),
    ("input-NUL", {"input": "\x00"}, 200, None, _),
    ("input-NUL-inside", {"input": "Hi\x00there."}, 200, None, _),
    ("input-control-chars", {"input": "".join(map(chr, range(1, 32)))}, 200, None, _),
    ("input-emoji", {"input": "\U0001F600" * 50}, 200, None, _),
    ("input-bidi-and-zalgo", {"input": "\u202e" * 10 + "Z\u0336\u0337" * 20}, 200, None, _),
    ("input-noncharacters", {"input": "\uffff\U0010ffff\ue000"}, 200, None, _),
    ("input-BOM-only", {"input": "\ufeff"}, 200, None, _),
    ("context-not-a-list", {"context": "turn"}, 400, "invalid_value", "context"),
    ("context-null-item", {"context": [None]}, 400, "invalid_value", "context[0]"),
    ("context-number-items", {"context": [1, 2]}, 400, "invalid_value", "context[0]"),
    ("context-10000-empty-turns", {"context": [{}] * 10_000}, 400, "context_too_long", "context"),
    ("context-speaker-string", {"context": [{"speaker": "1"}]}, 400, "invalid_value", "context[0].speaker"),
    ("context-text-4097", {"context": [{"text": "x" * 4097}]}, 400, "context_too_long", "context[0].text"),
    ("context-audio-and-voice", {"context": [{"audio": b64(wav_bytes(0.5)), "voice_id": "v"}]}, 400,
     "invalid_value", "context[0]"),
    ("context-unknown-voice-id", {"context": [{"voice_id": "x" * 10_000}]}, 404, "voice_not_found",
     "context[0].voice_id"),
    ("context-audio-int", {"context": [{"audio": 5}]}, 400, "invalid_value", "context[0].audio"),
    ("context-audio-bad-data-url", {"context": [{"audio": "data:audio/wav;base64,!!!"}]}, 400, "invalid_base64",
     "context[0].audio"),
    ("unknown-fields-nested-garbage", {"stream": True, "x": {"y": [None, {"z": 1e308}]}}, 200, None, _),
]


@pytest.mark.parametrize("patch, status, code, param", [c[1:] for c in SPEECH_CASES], ids=[c[0] for c in SPEECH_CASES])
def test_speech_json(srv, patch, status, code, param):
    r = srv.http.post("/v1/audio/speech", json={**SPEECH, **patch})
    check(r, status, code, param)
    if status == 200:
        assert len(r.content) and len(r.content) % FRAME_BYTES == 0
    alive(srv)


def test_speech_json_group_still_serves(srv):
    still_serves(srv)


# ---- raw speech bodies: (id, bytes, content-type, status, code)
GOOD = json.dumps(SPEECH).encode()
RAW_CASES = [
    ("empty-body", b"", "application/json", 400, "missing_required_parameter"),
    ("whitespace-body", b" \r\n\t ", "application/json", 400, "missing_required_parameter"),
    ("json-null", b"null", "application/json", 400, "invalid_json"),
    ("json-array", b"[]", "application/json", 400, "invalid_json"),
    ("json-string", b'"Hello."', "application/json", 400, "invalid_json"),
    ("not-json", b"{model: tts-1}", "application/json", 400, "invalid_json"),
    ("trailing-garbage", GOOD + b" }", "application/json", 400, "invalid_json"),
    ("utf16", json.dumps(SPEECH).encode("utf-16"), "application/json", 400, "invalid_json"),
    ("utf8-bom", b"\xef\xbb\xbf" + GOOD, "application/json", 400, "invalid_json"),
    ("invalid-utf8-in-string", GOOD.replace(b"Hello.", b"\xff\xfe"), "application/json", 400, "invalid_json"),
    ("lone-surrogate", GOOD.replace(b"Hello.", b"\\ud800"), "application/json", 400, None),
    ("escaped-surrogate-pair", GOOD.replace(b"Hello.", b"\\ud83d\\ude00 hi"), "application/json", 200, None),
    ("NaN-literal", GOOD[:-1] + b', "temperature": NaN}', "application/json", 400, "invalid_value"),
    ("Infinity-literal", GOOD[:-1] + b', "top_p": Infinity}', "application/json", 400, "invalid_value"),
    ("1e400", GOOD[:-1] + b', "temperature": 1e400}', "application/json", 400, "invalid_value"),
    ("nested-100000-deep", GOOD[:-1] + b', "context": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "application/json", 400, "invalid_json"),
    ("100000-unknown-keys", b"{" + b",".join(b'"k%d":0' % i for i in range(100_000)) + b"," + GOOD[1:],
     "application/json", 200, None),
    ("duplicate-key-last-good", GOOD[:-1] + b', "input": 42, "input": "Hi."}', "application/json", 200, None),
    ("duplicate-key-last-bad", GOOD[:-1] + b', "input": "Hi.", "input": 42}', "application/json", 400,
     "invalid_value"),
    # JSON is read only as application/json (issue 39: a text/plain or form POST is a browser's simple request)
    ("content-type-text-plain", GOOD, "text/plain", 415, "unsupported_media_type"),
    ("content-type-form", GOOD, "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    ("content-type-multipart", GOOD, "multipart/form-data; boundary=x", 415, "unsupported_media_type"),
    ("content-type-xml-with-xml", b"<speech><input>Hi</input></speech>", "application/xml", 415,
     "unsupported_media_type"),
    ("content-type-json-charset", GOOD, "application/json; charset=utf-8", 200, None),
]


@pytest.mark.parametrize("body, ctype, status, code", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_speech_raw_body(srv, body, ctype, status, code):
    r = srv.http.post("/v1/audio/speech", content=body, headers={"content-type": ctype})
    check(r, status, code)
    alive(srv)


def test_speech_raw_group_still_serves(srv):
    still_serves(srv)


# ---- context[].audio: (id, file bytes, status, code)
AUDIO_CASES = [
    ("wav-8-channels", raw_wav(channels=8), 200, None),
    ("wav-16-channels-extensible", raw_wav(channels=16, extensible=True), 200, None),
    ("wav-7.1-mask", raw_wav(channels=8, extensible=True, mask=0x63F), 200, None),
    ("wav-mask-fewer-than-channels", raw_wav(channels=6, extensible=True, mask=0x3), 200, None),
    ("wav-1-hz", raw_wav(rate=1, samples=10), 400, "invalid_audio"),
    ("wav-2^31-hz", raw_wav(rate=2**31 - 1, samples=1000), 400, "invalid_audio"),
    ("wav-384-khz", raw_wav(rate=384_000, samples=192_000), 200, None),
    ("wav-0-samples", raw_wav(samples=0), 400, "invalid_audio"),
    ("wav-1-sample", raw_wav(samples=1), 400, "audio_too_short"),
    ("wav-61-s", raw_wav(rate=4_000, samples=4_000 * 61, bits=8), 400, "audio_too_long"),
    ("wav-nan", nan_wav(), 400, "invalid_audio"),
    ("wav-inf-stereo", nan_wav(2, np.inf), 400, "invalid_audio"),
    ("wav-truncated-header", raw_wav()[:30], 400, "invalid_audio"),
    ("wav-truncated-data", raw_wav()[:30_000], 200, None),
    ("not-audio-text", b"this is not audio " * 100, 400, "invalid_audio"),
    ("not-audio-png", b"\x89PNG\r\n\x1a\n" + bytes(500), 400, "invalid_audio"),
    ("empty-file", b"", 400, "invalid_audio"),
]


@pytest.mark.parametrize("data, status, code", [c[1:] for c in AUDIO_CASES], ids=[c[0] for c in AUDIO_CASES])
def test_context_audio(srv, data, status, code):
    r = srv.http.post("/v1/audio/speech", json={**SPEECH, "context": [{"speaker": 1, "text": "Before.",
                                                                      "audio": b64(data)}]})
    check(r, status, code, "context[0].audio" if status == 400 else ...)
    alive(srv)


def test_context_audio_group_still_serves(srv):
    still_serves(srv)


# ---- voice uploads (multipart): (id, httpx.post kwargs, status, code)
def _upload(data: bytes, **fields) -> dict:
    return {"files": {"audio_sample": ("a.wav", data, "audio/wav")}, "data": {"name": "h", **fields}}


def _multipart(body: bytes) -> dict:
    return {"content": body, "headers": {"content-type": "multipart/form-data; boundary=x"}}


def _text_parts(**fields: str) -> dict:
    """multipart/form-data of text fields only (no file part)."""
    parts = b"".join(b'--x\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (k.encode(), v.encode())
                     for k, v in fields.items())
    return _multipart(parts + b"--x--\r\n")


VOICE_CASES = [
    ("voice-8-channels", _upload(raw_wav(channels=8), transcript="A tone."), 200, None),
    ("voice-12-channels-8-bit", _upload(raw_wav(channels=12, bits=8)), 200, None),
    ("voice-nan", _upload(nan_wav()), 400, "invalid_audio"),
    ("voice-empty-file", _upload(b""), 400, "invalid_audio"),
    ("voice-1-hz", _upload(raw_wav(rate=1, samples=30)), 400, "invalid_audio"),
    ("voice-not-audio", _upload(b"GIF89a" * 1000), 400, "invalid_audio"),
    ("voice-speaker-999", _upload(raw_wav(), speaker="999"), 400, "invalid_value"),
    ("voice-speaker-float", _upload(raw_wav(), speaker="1.5"), 400, "invalid_value"),
    ("voice-name-NUL", _upload(raw_wav(), name="\x00"), 200, None),
    ("voice-name-5000", _upload(raw_wav(), name="n" * 5000), 400, "invalid_value"),
    ("voice-transcript-5000", _upload(raw_wav(), transcript="t" * 5000), 400, "invalid_value"),
    ("voice-no-name", {"files": {"audio_sample": ("a.wav", raw_wav(), "audio/wav")}}, 400,
     "missing_required_parameter"),
    ("voice-sample-as-text-field", {"data": {"name": "h", "audio_sample": "not a file"}}, 415,
     "unsupported_media_type"),  # a urlencoded form: multipart/form-data only
    ("voice-sample-as-text-part", _text_parts(name="h", audio_sample="not a file"), 400, "invalid_value"),
    ("voice-json-body", {"json": {"name": "h"}}, 415, "unsupported_media_type"),
    ("voice-multipart-no-boundary", {"content": b"garbage", "headers": {"content-type": "multipart/form-data"}}, 400,
     "invalid_multipart"),
    ("voice-multipart-bad-framing", _multipart(b"garbage"), 400, "invalid_multipart"),
    ("voice-multipart-truncated", _multipart(b'--x\r\nContent-Disposition: form-data; name="name"\r\n\r\nabc'), 400,
     None),
    ("voice-invalid-utf8-name", _multipart(
        b'--x\r\nContent-Disposition: form-data; name="name"\r\n\r\n\xff\xfe\r\n--x\r\nContent-Disposition: '
        b'form-data; name="audio_sample"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n' + raw_wav()
        + b"\r\n--x--\r\n"), 200, None),
]


@pytest.mark.parametrize("kw, status, code", [c[1:] for c in VOICE_CASES], ids=[c[0] for c in VOICE_CASES])
def test_voice_upload(srv, kw, status, code):
    r = srv.http.post("/v1/audio/voices", **kw)
    check(r, status, code)
    alive(srv)


def test_voice_upload_group_still_serves(srv):
    still_serves(srv)


# ---- routes: (id, method, path, status, code)
ROUTE_CASES = [
    ("get-voice-NUL", "GET", "/v1/audio/voices/%00", 404, "voice_not_found"),
    ("get-voice-5000-chars", "GET", "/v1/audio/voices/" + "v" * 5000, 404, "voice_not_found"),
    ("get-voice-invalid-utf8", "GET", "/v1/audio/voices/%ff", 404, "voice_not_found"),
    ("get-model-traversal", "GET", "/v1/models/..%2F..%2Fetc%2Fpasswd", 404, "model_not_found"),
    ("delete-alias", "DELETE", "/v1/audio/voices/alloy", 404, "voice_not_found"),
    ("post-models", "POST", "/v1/models", 405, "method_not_allowed"),
    ("patch-speech", "PATCH", "/v1/audio/speech", 405, "method_not_allowed"),
    ("unknown-path", "GET", "/v1/%ff/../x", 404, "not_found"),
]


@pytest.mark.parametrize("method, path, status, code", [c[1:] for c in ROUTE_CASES], ids=[c[0] for c in ROUTE_CASES])
def test_routes(srv, method, path, status, code):
    if path == "/v1/audio/voices/%00":  # a voice *named* NUL may exist (voice-name-NUL): make sure it does not
        for v in srv.http.get("/v1/audio/voices").json()["data"]:
            if v.get("name") == "\x00":
                srv.http.delete(f"/v1/audio/voices/{v['id']}")
    check(srv.http.request(method, path), status, code)
    alive(srv)


# ---- raw HTTP: (id, bytes sent on a fresh connection, status line start, code)
HTTP_CASES = [
    ("garbage-request-line", b"GARBAGE\r\n\r\n", 400, "invalid_http"),
    ("bad-chunk-size", b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
     "invalid_http"),
    ("content-length-negative", b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400,
     "invalid_http"),
    ("headers-over-the-limit-in-pieces", None, 400, "invalid_http"),
    # the same head in one read: h11 takes it whole, the guard measures it
    ("headers-over-the-limit-at-once", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 40_000
     + b"\r\n\r\n", 400, "invalid_http"),
]


@pytest.mark.parametrize("data, status, code", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_raw_http(srv, data, status, code):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        if data is None:  # h11 buffers at most max_header_bytes of an incomplete head: sent in pieces past it
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            try:
                for _ in range(40):
                    s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
            except OSError:
                pass
        else:
            s.sendall(data)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), answer[:300]
    err = json.loads(body)["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    alive(srv)


def test_routes_and_http_group_still_serves(srv):
    still_serves(srv)


# ---- the WebSocket: (id, messages on one connection, the reply awaited: "error:<code>" | a message type)
WS_OK = {"context_id": "ok", "text": "Fine.", "flush": True, "max_audio_length_ms": 160}
WS_CASES = [
    ("ws-binary-frame", [b"\x00\x01\x02"], "error:invalid_message"),
    ("ws-not-json", ["{nope"], "error:invalid_json"),
    ("ws-json-array", ["[]"], "error:invalid_message"),  # JSON, not an object
    ("ws-json-null", ["null"], "error:invalid_message"),
    ("ws-empty-text", [""], "error:invalid_json"),
    ("ws-nested-100000", ["[" * 100_000], "error:invalid_json"),
    ("ws-lone-surrogate", ['{"context_id": "a", "text": "\\ud800", "flush": true}'], "error:invalid_json"),
    ("ws-context-id-1000", [json.dumps({"context_id": "c" * 1000, "text": "Hi."})], "error:invalid_value"),
    ("ws-context-id-int", [json.dumps({"context_id": 5})], "error:invalid_value"),
    ("ws-temperature-NaN", ['{"context_id": "a", "temperature": NaN}'], "error:invalid_value"),
    ("ws-seed-2^64", [json.dumps({"seed": 2**64})], "error:invalid_value"),
    ("ws-text-5000", [json.dumps({"context_id": "a", "text": "x" * 5000})], "error:input_too_long"),
    ("ws-text-int", [json.dumps({"text": 5})], "error:invalid_value"),
    ("ws-length-huge", [json.dumps({**WS_OK, "max_audio_length_ms": 10**9})], "error:invalid_value"),
    ("ws-output-format-mp3", [json.dumps({"output_format": "mp3"})], "error:invalid_value"),
    ("ws-voice-missing", [json.dumps({**WS_OK, "context_id": "nv", "voice": "nobody"})], "error:voice_not_found"),
    ("ws-add-context-not-audio", [json.dumps({"add_context": [{"audio": b64(b"junk" * 100)}]})],
     "error:invalid_audio"),
    ("ws-add-context-1-hz", [json.dumps({"add_context": [{"audio": b64(raw_wav(rate=1, samples=5))}]})],
     "error:invalid_audio"),
    ("ws-add-context-not-a-list", [json.dumps({"add_context": "x"})], "error:invalid_value"),
    ("ws-add-context-8-channels", [json.dumps({"context_id": "m", "add_context": [{"audio": b64(raw_wav(channels=8))}],
                                               **{k: v for k, v in WS_OK.items() if k != "context_id"}})],
     "flush_done"),
    ("ws-NUL-text", [json.dumps({**WS_OK, "text": "\x00 Hi."})], "flush_done"),
    ("ws-duplicate-keys", ['{"context_id": "d", "text": 5, "text": "Hi.", "flush": true, "max_audio_length_ms": 160}'],
     "flush_done"),
    ("ws-cancel-unknown", [json.dumps({"context_id": "zz", "cancel": True})], "cancelled"),
    ("ws-close-unknown", [json.dumps({"context_id": "zz2", "close": True})], "done"),
]


@pytest.mark.parametrize("messages, expect", [c[1:] for c in WS_CASES], ids=[c[0] for c in WS_CASES])
def test_websocket(srv, messages, expect):
    with connect(srv.url.replace("http://", "ws://") + "/v1/audio/speech/stream", max_size=None) as ws:
        for m in messages:
            ws.send(m)
        while True:
            reply = json.loads(ws.recv(timeout=60))
            if reply["type"] not in ("audio", "segment"):
                break
        kind, _, code = expect.partition(":")
        assert reply["type"] == kind, reply
        if kind == "error":
            assert reply["error"]["code"] == code and set(reply["error"]) == {"message", "type", "param", "code"}
        cid = f"ok-{len(messages[0])}"
        ws.send(json.dumps({**WS_OK, "context_id": cid}))  # the same connection goes on
        while (reply := json.loads(ws.recv(timeout=60)))["type"] == "audio":
            pass
        assert reply["type"] == "flush_done" and reply["context_id"] == cid, reply
    alive(srv)


def test_websocket_group_still_serves(srv):
    still_serves(srv)


def test_the_table_is_at_least_60_cases():
    n = sum(map(len, (SPEECH_CASES, RAW_CASES, AUDIO_CASES, VOICE_CASES, ROUTE_CASES, HTTP_CASES, WS_CASES)))
    assert n >= 60, n
