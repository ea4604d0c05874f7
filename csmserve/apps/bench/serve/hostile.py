"""Hostile requests for the soak: a sample of tests/server/test_hostile.py's table, each with the answer it
must get. Over HTTP (`json`: a patch of a good speech body; `raw`: body bytes; `voice`: a multipart upload;
`route`: method + path; `socket`: bytes on a fresh connection) and the WebSocket (`ws`: messages, the
reply awaited; `@CID@` stands for a context_id of the user's own). A status >= 400 must come in OpenAI's
error shape with a non-null code (and this one).

    CASES[i] -> Case(name, kind, payload, status, code)
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from csmserve.apps.bench.serve.server import wav

GOOD = {"model": "tts-1", "voice": "alloy", "input": "Hello.", "response_format": "pcm",
        "max_audio_length_ms": 240}
WS_OK = {"text": "Fine.", "flush": True, "max_audio_length_ms": 240}
CID = "@CID@"  # in a ws case's messages: replaced by a context_id of the sending user's own


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _nan_wav(channels: int = 1, value: float = np.nan) -> bytes:
    return wav(channels, seconds=0.5, data=np.full((12_000, channels), value), float32=True)


def _upload(data: bytes, **fields) -> dict:
    return {"files": {"audio_sample": ("a.wav", data, "audio/wav")}, "data": {"name": "soak-hostile", **fields}}


def _ctx(audio: str) -> dict:
    return {"context": [{"speaker": 1, "text": "Before.", "audio": audio}]}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # json | raw | voice | route | socket | ws
    payload: object
    status: int  # HTTP status; ws: 0 (the reply below)
    code: str | None  # the error code (None: any non-null one); ws: "error:<code>" or the message type awaited


def _cases() -> list[Case]:
    good = json.dumps(GOOD).encode()
    nested = good[:-1] + b', "context": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    return [
        # speech JSON: types, numbers, sizes, unicode, context
        Case("input-null", "json", {"input": None}, 400, "invalid_value"),
        Case("input-list", "json", {"input": ["Hello."]}, 400, "invalid_value"),
        Case("voice-null", "json", {"voice": None}, 400, "invalid_value"),
        Case("model-int", "json", {"model": 1}, 400, "invalid_value"),
        Case("temperature-word", "json", {"temperature": "hot"}, 400, "invalid_value"),
        Case("temperature-1e-38", "json", {"temperature": 1.175494351e-38}, 200, None),
        Case("temperature-subnormal", "json", {"temperature": 5e-324}, 200, None),
        Case("temperature-above-2", "json", {"temperature": 2.0000001}, 400, "invalid_value"),
        Case("top-p-zero", "json", {"top_p": 0}, 400, "invalid_value"),
        Case("top-k-2^64", "json", {"top_k": 2**64}, 400, "invalid_value"),
        Case("seed-2^63", "json", {"seed": 2**63}, 400, "invalid_value"),
        Case("seed-4000-digits", "json", {"seed": int("9" * 4000)}, 400, "invalid_value"),
        Case("length-2^70", "json", {"max_audio_length_ms": 2**70}, 400, "invalid_value"),
        Case("speed-word", "json", {"speed": "fast"}, 400, "invalid_value"),
        Case("format-uppercase", "json", {"response_format": "PCM"}, 400, "invalid_value"),
        Case("input-4097", "json", {"input": "é" * 4097}, 400, "input_too_long"),
        Case("input-spaces", "json", {"input": "\u2003\u3000\u00a0"}, 400, "empty_input"),
        Case("input-control-chars", "json", {"input": "".join(map(chr, range(1, 32))) + "Hi."}, 200, None),
        Case("voice-unknown", "json", {"voice": "soak-nobody"}, 404, "voice_not_found"),
        Case("context-not-a-list", "json", {"context": "turn"}, 400, "invalid_value"),
        Case("context-null-item", "json", {"context": [None]}, 400, "invalid_value"),
        Case("context-text-4097", "json", {"context": [{"text": "x" * 4097}]}, 400, "context_too_long"),
        Case("context-unknown-voice", "json", {"context": [{"voice_id": "soak-nobody"}]}, 404, "voice_not_found"),
        Case("context-8-channels", "json", _ctx(_b64(wav(8))), 200, None),
        Case("context-16-channels", "json", _ctx(_b64(wav(16, rate=16_000, extensible=True))), 200, None),
        Case("context-nan", "json", _ctx(_b64(_nan_wav())), 400, "invalid_audio"),
        Case("context-inf-stereo", "json", _ctx(_b64(_nan_wav(2, np.inf))), 400, "invalid_audio"),
        Case("context-bad-base64", "json", _ctx("data:audio/wav;base64,!!!"), 400, "invalid_base64"),
        Case("context-not-audio", "json", _ctx(_b64(b"this is not audio " * 50)), 400, "invalid_audio"),
        # raw bodies
        Case("body-empty", "raw", b"", 400, "missing_required_parameter"),
        Case("body-null", "raw", b"null", 400, "invalid_json"),
        Case("body-not-json", "raw", b"{model: tts-1}", 400, "invalid_json"),
        Case("body-trailing-garbage", "raw", good + b" }", 400, "invalid_json"),
        Case("body-utf16", "raw", json.dumps(GOOD).encode("utf-16"), 400, "invalid_json"),
        Case("body-NaN", "raw", good[:-1] + b', "temperature": NaN}', 400, "invalid_value"),
        Case("body-1e400", "raw", good[:-1] + b', "temperature": 1e400}', 400, "invalid_value"),
        Case("body-nested-20000", "raw", nested, 400, "invalid_json"),
        Case("body-xml", "raw", b"<speech><input>Hi</input></speech>", 400, "invalid_json"),
        # voice uploads
        Case("voice-nan", "voice", _upload(_nan_wav()), 400, "invalid_audio"),
        Case("voice-empty-file", "voice", _upload(b""), 400, "invalid_audio"),
        Case("voice-not-audio", "voice", _upload(b"GIF89a" * 500), 400, "invalid_audio"),
        Case("voice-speaker-999", "voice", _upload(wav(), speaker="999"), 400, "invalid_value"),
        Case("voice-no-name", "voice", {"files": {"audio_sample": ("a.wav", wav(), "audio/wav")}}, 400,
             "missing_required_parameter"),
        Case("voice-multipart-garbage", "voice", {"content": b"garbage",
                                                  "headers": {"content-type": "multipart/form-data; boundary=x"}},
             400, "invalid_multipart"),
        Case("voice-8-channels", "voice", _upload(wav(8), transcript="A tone."), 200, None),  # deleted after
        # routes, raw HTTP
        Case("get-voice-NUL", "route", ("GET", "/v1/audio/voices/%00"), 404, "voice_not_found"),
        Case("delete-alias", "route", ("DELETE", "/v1/audio/voices/alloy"), 404, "voice_not_found"),
        Case("model-traversal", "route", ("GET", "/v1/models/..%2F..%2Fetc%2Fpasswd"), 404, "model_not_found"),
        Case("patch-speech", "route", ("PATCH", "/v1/audio/speech"), 405, "method_not_allowed"),
        Case("garbage-request-line", "socket", b"GARBAGE\r\n\r\n", 400, "invalid_http"),
        # the WebSocket (on a conversation's connection, between its turns; it must serve the next turn)
        Case("ws-binary-frame", "ws", [b"\x00\x01\x02garbage"], 0, "error:invalid_message"),
        Case("ws-not-json", "ws", ["{nope"], 0, "error:invalid_json"),
        Case("ws-nested-100000", "ws", ["[" * 100_000], 0, "error:invalid_json"),
        Case("ws-context-id-int", "ws", [json.dumps({"context_id": 5})], 0, "error:invalid_value"),
        Case("ws-temperature-NaN", "ws", ['{"context_id": "%s", "temperature": NaN}' % CID], 0, "error:invalid_value"),
        Case("ws-text-int", "ws", [json.dumps({"context_id": CID, "text": 5})], 0, "error:invalid_value"),
        Case("ws-voice-missing", "ws", [json.dumps({**WS_OK, "context_id": CID, "voice": "soak-nobody"})], 0,
             "error:voice_not_found"),
        Case("ws-add-context-not-audio", "ws", [json.dumps({"context_id": CID,
                                                            "add_context": [{"audio": _b64(b"junk" * 100)}]})],
             0, "error:invalid_audio"),
        Case("ws-output-format-mp3", "ws", [json.dumps({"context_id": CID, "output_format": "mp3"})], 0,
             "error:invalid_value"),
        Case("ws-add-context-8-channels", "ws", [json.dumps({**WS_OK, "context_id": CID,
                                                             "add_context": [{"audio": _b64(wav(8))}]})],
             0, "flush_done"),
    ]


CASES = _cases()
HTTP_CASES = [c for c in CASES if c.kind != "ws"]
WS_CASES = [c for c in CASES if c.kind == "ws"]


def error_shape(body: bytes, code: str | None) -> str | None:
    """None if `body` is OpenAI's error shape with a non-null code (== `code` when given), else what is wrong."""
    try:
        obj = json.loads(body)
    except ValueError:
        return "not JSON"
    if not isinstance(obj, dict) or set(obj) != {"error"} or not isinstance(obj["error"], dict):
        return "not {'error': {...}}"
    err = obj["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"keys {sorted(err)}"
    if not isinstance(err["code"], str) or not err["code"]:
        return "null code"
    if not isinstance(err["message"], str) or not err["message"]:
        return "no message"
    if code is not None and err["code"] != code:
        return f"code {err['code']}"
    return None
