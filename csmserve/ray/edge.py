"""ReplicaEdge: a replica's ASGI app as Ray Serve runs it: csmserve's own app (every route, streaming,
the WebSocket), plus

- an `x-csmserve-replica` header on every response and WebSocket accept (which replica served it);
- `GET /ready` for the application: 200 while at least one replica is ready, with how many are
  (503 `no_replica_ready` otherwise); `GET /health` stays the answering replica's own;
- `GET /metrics` for the application: every replica's metrics in one text, labelled `replica`;
- a speech body the proxy sent along with the request (affinity.py) is the body: no call back for it.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from csmserve.server.errors import APIError
from csmserve.ray.affinity import BODY_EXTENSION
from csmserve.ray.directory import merge_metrics, readiness

REPLICA_HEADER = b"x-csmserve-replica"


def _route(scope: Scope) -> str:
    """The path below the application's route prefix (Serve puts the prefix in root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _prefetched(body: bytes, receive: Receive) -> Receive:
    """The body the proxy sent along (affinity.py), then the proxy's own messages without their copy of
    it (http.disconnect)."""
    sent = False

    async def prefetched() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message

    return prefetched


class ReplicaEdge:
    def __init__(self, app: ASGIApp, replica: str, cluster: Callable[[], Awaitable[dict[str, dict]]]) -> None:
        self.app, self.replica, self.cluster = app, replica, cluster
        self.state = getattr(getattr(app, "state", None), "server", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and _route(scope) in ("/ready", "/metrics"):
            reports = await self.cluster()
            if _route(scope) == "/ready":
                return await self._ready(reports, send)
            text = merge_metrics({r: s.get("metrics", "") for r, s in reports.items()})
            return await self._respond(send, 200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        body = (scope.get("extensions") or {}).get(BODY_EXTENSION)
        if body is not None:
            receive = _prefetched(body, receive)

        async def tagged(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.replica.encode())]}
            await send(message)

        await self.app(scope, receive, tagged)

    async def _ready(self, reports: dict[str, dict], send: Send) -> None:
        r = readiness(reports)
        if r["ready"] == 0:
            err = APIError(503, f"no replica is ready ({r['total']} reporting: {r['replicas']})", "no_replica_ready")
            body = {**err.body(), "replicas": r}
            return await self._respond(send, 503, json.dumps(body).encode(), b"application/json")
        model = self.state.config.model_name if self.state is not None else None
        body = {"status": "ready", "model": model, "replicas": r, "replica": self.replica}
        await self._respond(send, 200, json.dumps(body).encode(), b"application/json")

    async def _respond(self, send: Send, status: int, body: bytes, content_type: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type), (b"content-length", str(len(body)).encode()),
            (REPLICA_HEADER, self.replica.encode())]})
        await send({"type": "http.response.body", "body": body})
