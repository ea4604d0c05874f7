"""Cross-site requests: a request whose `Origin` is another site is refused (403, OpenAI's error shape), over
HTTP and at the WebSocket handshake, unless --cors-origins names that origin (`*`: any).

CORS alone does not protect a server on localhost: a "simple request" (a POST of text/plain or a form) runs
without a preflight, and a WebSocket handshake is not subject to CORS at all. Browsers send `Origin` on every
such request, so this is where they are told apart (as Jupyter does). Requests without an `Origin` and the
server's own page are not affected (docs/reliability.md).
"""
from __future__ import annotations

import json
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from csmserve.server.errors import APIError

_DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


def _netloc(scheme: str, netloc: str) -> str:
    """host[:port] lowercased, without the scheme's default port."""
    netloc = netloc.strip().lower()
    port = _DEFAULT_PORTS.get(scheme)
    return netloc[: -len(port) - 1] if port and netloc.endswith(":" + port) else netloc


def same_origin(origin: str, host: str) -> bool:
    """`origin` (a browser's Origin header) names the host the request was sent to (its Host header)."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (a sandboxed frame, a file:// page) and anything odd
    return _netloc(parts.scheme, parts.netloc) == _netloc(parts.scheme, host)


class OriginMiddleware:
    """Refuses HTTP requests and WebSocket handshakes from another site's page (see the module's doc)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = {o.rstrip("/").lower() for o in allowed}

    def refused(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None or self.any:
            return None
        origin_s = origin.decode("latin-1").strip()
        host = headers.get(b"host", b"").decode("latin-1")
        if origin_s.rstrip("/").lower() in self.allowed or same_origin(origin_s, host):
            return None
        return APIError(403, f"requests from the page of another site ({origin_s[:200]}) are refused; to allow a "
                        "web app's origin, start the server with --cors-origins naming it", "origin_not_allowed")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.refused(scope) if scope["type"] in ("http", "websocket") else None
        if error is None:
            return await self.app(scope, receive, send)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 403, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):  # the handshake's answer: 403 with the error
            await send({"type": "websocket.http.response.start", "status": 403, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})  # before accept: the server answers 403
