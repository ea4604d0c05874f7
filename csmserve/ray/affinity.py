"""How a request's body reaches the router: an ASGI middleware in each Ray Serve proxy.

Ray Serve routes a request before its body is read (the replica pulls the body from the proxy later),
so the router sees only headers. This middleware, installed in every proxy through Ray's
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=csmserve.ray.affinity.proxy_middlewares` (set by
`csmserve serve --ray`; on your own cluster: in the environment of `ray start`), reads the JSON body of
`POST .../v1/audio/speech` (when it says its length and that is at most PEEK_BYTES), hands the same
bytes on to the replica, and puts the request's affinity key into the session header
(`x-session-id`, Ray's `RAY_SERVE_SESSION_ID_HEADER_KEY`), which Ray passes to the router as
`RequestMetadata.session_id` (csmserve/ray/router.py). A client that sends that header itself keeps it.
The body it read also travels in the request itself (BODY_EXTENSION, when small): the replica uses it
instead of fetching the body back from the proxy.

The key (hashed: any characters are fine in a context_id):
- WebSocket: `?context_id=` of the URL (a conversation reconnecting lands where its session lives);
- speech: a `context_id` field (extra_body) -> that conversation; else a non-empty `context` -> the
  voice and the first context turn (a conversation sent turn by turn starts the same way every time);
  else a stored voice (not an OpenAI alias: aliases carry no clip, so no prefix worth keeping) -> it;
- anything else: no key (least loaded).
"""
from __future__ import annotations

import hashlib
import json
import os
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PEEK_BYTES = 4 << 20  # larger bodies (context clips in base64) go unread: least loaded
# bodies up to this ride along in the ASGI scope Ray pickles into its call to the replica, so the
# replica need not call back to the proxy for them (one round trip less before the first audio; edge.py)
INLINE_BYTES = 1 << 20
BODY_EXTENSION = "csmserve.body"
SESSION_HEADER = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower().encode()
_ALIASES = frozenset(("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                      "verse", "marin", "cedar"))  # csmserve.voices.OPENAI_VOICES (not imported: no numpy here)


def _h(*parts: object) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def speech_key(body: object) -> str | None:
    """The affinity key of a POST /v1/audio/speech body (parsed JSON), or None."""
    if not isinstance(body, dict):
        return None
    cid = body.get("context_id")
    if isinstance(cid, str) and cid:
        return "ctx:" + _h(cid)
    voice = body.get("voice")
    voice = voice.get("id") if isinstance(voice, dict) else voice
    if not isinstance(voice, str):
        voice = None
    context = body.get("context")
    if isinstance(context, list) and context and isinstance(context[0], dict):
        first = context[0]
        audio = first.get("audio")
        audio = hashlib.blake2b(audio.encode(), digest_size=12).hexdigest() if isinstance(audio, str) else None
        return "conv:" + _h(voice, first.get("speaker"), first.get("text"), first.get("voice_id"), audio)
    if voice and voice.lower() not in _ALIASES:
        return "voice:" + _h(voice)
    return None


def websocket_key(query_string: bytes) -> str | None:
    cid = parse_qs(query_string.decode("latin-1")).get("context_id")
    return "ctx:" + _h(cid[0]) if cid and cid[0] else None


class AffinityMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        keyed = any(k == SESSION_HEADER for k, _ in scope["headers"])  # the client's own key wins
        key = None
        if scope["type"] == "websocket":
            key = None if keyed else websocket_key(scope.get("query_string", b""))
        elif scope["method"] == "POST" and scope["path"].endswith("/v1/audio/speech"):
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) <= PEEK_BYTES:
                messages, body = await _read_body(receive)
                receive = _replay(messages, receive)
                if not keyed:
                    try:
                        key = speech_key(json.loads(body))
                    except (ValueError, UnicodeDecodeError):
                        key = None  # the replica answers a bad body
                if len(body) <= INLINE_BYTES and messages[-1]["type"] == "http.request":
                    scope = {**scope, "extensions": {**(scope.get("extensions") or {}), BODY_EXTENSION: body}}
        if key is not None:
            scope = {**scope, "headers": [*scope["headers"], (SESSION_HEADER, key.encode())]}
        await self.app(scope, receive, send)


async def _read_body(receive: Receive) -> tuple[list[Message], bytes]:
    messages, chunks = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return messages, b"".join(chunks)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The messages already read, then the client's own (http.disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def proxy_middlewares() -> list:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH target: the middlewares of every Serve proxy."""
    from starlette.middleware import Middleware

    return [Middleware(AffinityMiddleware)]
