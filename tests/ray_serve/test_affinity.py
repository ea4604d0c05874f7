"""The proxy middleware (csmserve/ray/affinity.py): the body's routing key into the session header,
the body handed on unchanged."""
import asyncio
import json

import httpx
import pytest

from csmserve.ray.affinity import (BODY_EXTENSION, INLINE_BYTES, PEEK_BYTES, SESSION_HEADER, AffinityMiddleware,
                                   speech_key, websocket_key)


def test_keys():
    assert speech_key({"voice": "alloy", "input": "x"}) is None  # an alias: no clip, no key
    assert speech_key({"voice": {"id": "alloy"}}) is None
    v = speech_key({"voice": "voice_abc", "input": "one"})
    assert v.startswith("voice:") and v == speech_key({"voice": {"id": "voice_abc"}, "input": "two"})
    c = speech_key({"voice": "alloy", "context": [{"speaker": 1, "text": "Hi."}], "input": "a"})
    grown = speech_key({"voice": "alloy", "context": [{"speaker": 1, "text": "Hi."}, {"text": "more"}], "input": "b"})
    assert c.startswith("conv:") and c == grown  # a conversation keeps its key as it grows
    assert c != speech_key({"voice": "nova", "context": [{"speaker": 1, "text": "Hi."}]})
    assert speech_key({"voice": "alloy", "context_id": "talk-1"}) == websocket_key(b"context_id=talk-1")
    assert websocket_key(b"binary=1") is None and speech_key([1]) is None


async def _through(body: bytes, headers: dict[str, str]) -> dict:
    seen = {}

    async def app(scope, receive, send):
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        seen.update(headers=dict(scope["headers"]), body=b"".join(chunks),
                    inline=(scope.get("extensions") or {}).get(BODY_EXTENSION))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    transport = httpx.ASGITransport(app=AffinityMiddleware(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/audio/speech", content=body, headers=headers)
    assert r.status_code == 200
    return seen


@pytest.mark.parametrize("headers", [{}, {"x-session-id": "mine"}])
def test_middleware_sets_the_key_and_passes_the_body_on(headers):
    body = json.dumps({"model": "tts-1", "voice": "voice_abc", "input": "Hello."}).encode()
    seen = asyncio.run(_through(body, {"content-type": "application/json", **headers}))
    assert seen["body"] == body
    want = headers.get("x-session-id", speech_key(json.loads(body))).encode()
    assert seen["headers"][SESSION_HEADER] == want  # a client's own header wins
    assert seen["inline"] == body  # and the body rides along in the scope to the replica


def test_the_replica_takes_the_inlined_body_and_skips_the_proxied_copy():
    pytest.importorskip("ray.serve")
    from csmserve.ray.edge import _prefetched

    proxied = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        return proxied.pop(0)

    async def read_all():
        r = _prefetched(b"{}", receive)
        return [await r(), await r()]

    assert asyncio.run(read_all()) == [{"type": "http.request", "body": b"{}", "more_body": False},
                                       {"type": "http.disconnect"}]


def test_middleware_leaves_bad_and_large_bodies_alone():
    seen = asyncio.run(_through(b"{not json", {"content-type": "application/json"}))
    assert seen["body"] == b"{not json" and SESSION_HEADER not in seen["headers"]
    big = json.dumps({"voice": "voice_abc", "input": "x" * (PEEK_BYTES + 10)}).encode()
    seen = asyncio.run(_through(big, {"content-type": "application/json"}))
    assert seen["body"] == big and SESSION_HEADER not in seen["headers"] and seen["inline"] is None
    mid = json.dumps({"voice": "voice_abc", "input": "x" * (INLINE_BYTES + 10)}).encode()
    seen = asyncio.run(_through(mid, {"content-type": "application/json"}))  # keyed, not inlined
    assert seen["body"] == mid and SESSION_HEADER in seen["headers"] and seen["inline"] is None
