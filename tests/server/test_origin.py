"""Issue 39: the cross-site policy (server/origin.py, docs/reliability.md) and what each route takes.

A request whose Origin is another site is refused (403, the error shape) over HTTP and at the WebSocket
handshake, unless --cors-origins names it; no Origin (curl, SDKs) and the server's own page are served. JSON
routes take Content-Type: application/json only (415), POST /v1/audio/voices multipart/form-data only (415),
and a WebSocket message that is JSON but not an object says so."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from server_helpers import error_of, wav_bytes
from test_ws import recv_json, turn, ws_url

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "pcm", "max_audio_length_ms": 160}
EVIL = "http://evil.example"


def _voice(server, name: str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/audio/voices", data={"name": name, "transcript": "A tone."}, timeout=60,
                      files={"audio_sample": ("a.wav", wav_bytes(0.3), "audio/wav")}, headers=headers)


def _names(server) -> set[str]:
    return {v["name"] for v in httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]}


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 403, (r.status_code, r.text[:300])
    err = error_of(r)
    assert (err["type"], err["code"]) == ("permission_error", "origin_not_allowed") and "--cors-origins" in err["message"]


def test_another_sites_page_is_refused_and_the_pages_own_origin_served(server):
    url = f"{server.url}/v1/audio/speech"
    # another site: JSON, the "simple requests" that skip a preflight (text/plain, multipart), and the handshake
    _refused(httpx.post(url, json=SPEECH, headers={"Origin": EVIL}, timeout=60))
    _refused(httpx.post(url, content=json.dumps(SPEECH), headers={"Origin": EVIL, "content-type": "text/plain"}))
    _refused(_voice(server, "evil-voice", {"Origin": EVIL}))
    _refused(httpx.post(url, json=SPEECH, headers={"Origin": "null"}))  # a sandboxed frame, a file:// page
    _refused(httpx.post(url, json=SPEECH, headers={"Origin": server.url.replace("127.0.0.1", "localhost")}))
    assert "evil-voice" not in _names(server)
    with pytest.raises(InvalidStatus) as e:
        connect(ws_url(server), origin=EVIL, open_timeout=30)
    assert e.value.response.status_code == 403
    assert json.loads(e.value.response.body)["error"]["code"] == "origin_not_allowed"
    # the server's own page (the same host and port) and clients that send no Origin
    own = {"Origin": server.url}
    r = httpx.post(url, json=SPEECH, headers=own, timeout=60)
    assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2
    assert _voice(server, "own-page-voice", own).status_code == 200 and "own-page-voice" in _names(server)
    with connect(ws_url(server), origin=server.url, open_timeout=30) as ws:
        ws.send(json.dumps({"context_id": "own", "text": "Fine.", "flush": True, "max_audio_length_ms": 160}))
        audio, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done" and len(audio) == 2 * 1920 * 2
    assert httpx.post(url, json=SPEECH, timeout=60).status_code == 200


def test_cors_origins_names_the_sites_allowed(serve):
    app = "https://app.example"
    server = serve(cors_origins=(app,))
    url = f"{server.url}/v1/audio/speech"
    r = httpx.post(url, json=SPEECH, headers={"Origin": app}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app
    pre = httpx.options(url, headers={"Origin": app, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == app
    with connect(ws_url(server), origin=app, open_timeout=30) as ws:
        ws.send(json.dumps({"context_id": "app", "text": "Fine.", "flush": True, "max_audio_length_ms": 160}))
        assert turn(ws)[1][-1]["type"] == "flush_done"
    _refused(httpx.post(url, json=SPEECH, headers={"Origin": EVIL}, timeout=60))  # still: only the one named
    _refused(httpx.post(url, json=SPEECH, headers={"Origin": app + ":8443"}, timeout=60))
    r = httpx.post(url, json=SPEECH, headers={"Origin": server.url}, timeout=60)
    assert r.status_code == 200  # the page itself too
    anyone = serve(cors_origins=("*",))
    assert httpx.post(f"{anyone.url}/v1/audio/speech", json=SPEECH, headers={"Origin": EVIL},
                      timeout=60).status_code == 200


def test_json_routes_take_application_json_only(server):
    url = f"{server.url}/v1/audio/speech"
    body = json.dumps(SPEECH).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = httpx.post(url, content=body, headers={} if ctype is None else {"content-type": ctype})
        assert r.status_code == 415, (ctype, r.status_code)
        err = error_of(r)
        assert err["code"] == "unsupported_media_type" and "Content-Type: application/json" in err["message"]
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        assert httpx.post(url, content=body, headers={"content-type": ctype}, timeout=60).status_code == 200


def test_the_openai_client_is_unaffected(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with c.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Hi.", response_format="pcm",
                                                       extra_body={"max_audio_length_ms": 160}) as r:
        assert len(r.read()) == 2 * 1920 * 2


def test_json_posted_to_voices_says_the_route_takes_multipart(server):
    r = httpx.post(f"{server.url}/v1/audio/voices", json={"name": "h", "transcript": "A tone."})
    assert r.status_code == 415
    err = error_of(r)
    assert err["code"] == "unsupported_media_type" and "multipart/form-data" in err["message"], err
    assert "application/json" in err["message"] and "missing" not in err["message"]
    r = httpx.post(f"{server.url}/v1/audio/voices", data={"name": "h"})  # a form can carry no file
    assert r.status_code == 415 and "multipart/form-data" in error_of(r)["message"]


def test_websocket_json_that_is_not_an_object(server):
    with connect(ws_url(server)) as ws:
        for raw in ("[1,2]", "null", '"Hello."', "42"):
            ws.send(raw)
            m = recv_json(ws)
            assert m["type"] == "error" and m["error"]["code"] == "invalid_message", m
            assert m["error"]["message"].startswith("the message must be a JSON object"), m
            assert m["error"]["type"] == "invalid_request_error"
        ws.send("{nope")
        m = recv_json(ws)
        assert m["error"]["code"] == "invalid_json" and m["error"]["message"].startswith("message is not valid JSON: ")
        assert len(m["error"]["message"]) > len("message is not valid JSON: ")  # the reason
        ws.send(json.dumps({"context_id": "ok", "text": "Fine.", "flush": True, "max_audio_length_ms": 160}))
        assert turn(ws)[1][-1]["type"] == "flush_done"  # the connection goes on
