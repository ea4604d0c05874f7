"""Slow clients at the transport: uvicorn bounds idle keep-alive connections and the size of a request's headers,
but not how long the headers may take (one byte a second holds a socket forever): `with_header_timeout` adds that
deadline to uvicorn's h11 protocol (the body's is app.py's GuardMiddleware). `uvicorn_config` starts every server."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from csmserve.config import ServerConfig
from csmserve.server.errors import APIError


def raw_response(status: int, reason: str, error: APIError) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, written below h11 (then the connection closes)."""
    body = json.dumps(error.body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def with_header_timeout(base: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """`base` (uvicorn's H11Protocol) with a deadline for each request's headers, `seconds` from the first byte
    after the previous response (past it: 408, close); an unparsable request's 400 in OpenAI's shape too."""

    class HeaderTimeout(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the next request's headers are starting
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._header_timer = asyncio.get_running_loop().call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or a WebSocket
                return
            if self.cycle is not self._armed_cycle:  # a request's headers arrived meanwhile
                return
            self.transport.write(raw_response(408, "Request Timeout", APIError(
                408, f"the request headers took longer than {seconds:g} s", "request_timeout")))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:  # h11 refused the request (headers too large, bad framing)
            if not self.transport.is_closing():
                self.transport.write(raw_response(400, "Bad Request", APIError(
                    400, "not a valid HTTP/1.1 request (malformed, or headers past --max-header-bytes)",
                    "invalid_http")))
            self.transport.close()

    HeaderTimeout.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeout


def uvicorn_config(app: Any, config: ServerConfig, **kw: Any):
    """uvicorn.Config for `app` under `config`'s transport limits (kw: any other uvicorn.Config field)."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # h11 always (not httptools): its header size limit holds, and the header timeout knows its internals
    kw.setdefault("host", config.host)
    kw.setdefault("port", config.port)
    return uvicorn.Config(app, http=with_header_timeout(H11Protocol, config.header_timeout_s),
                          h11_max_incomplete_event_size=config.max_header_bytes,
                          timeout_keep_alive=config.keep_alive_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=config.shutdown_timeout_s,  # type: ignore[arg-type]
                          ws_max_size=2 * config.max_ws_message_bytes, ws_ping_interval=config.ws_ping_interval_s,
                          ws_ping_timeout=config.ws_ping_timeout_s, **kw)
