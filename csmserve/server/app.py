"""The FastAPI app: `create_app(CSM("sesame/csm-1b"), ServerConfig(api_key="secret"))`. `csm` may be None with
`load` given: /health answers at once, /ready and every model route 503 until `load()` (a thread) returns the CSM.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from csmserve.config import ServerConfig
from csmserve.voices import VoiceBackend, open_voice_store
from csmserve.server import adapters, errors, models, openapi, speech, voices, ws
from csmserve.server.errors import APIError, check_bearer
from csmserve.server.origin import OriginMiddleware
from csmserve.server.state import ServerState

if TYPE_CHECKING:
    from csmserve.api import CSM

log = logging.getLogger("csmserve.server")


def create_app(csm: CSM | None, config: ServerConfig | None = None, store: VoiceBackend | None = None,
               load: Callable[[], CSM] | None = None, sessions_path: str | None = None,
               worker: int | None = None, replica: str | None = None) -> FastAPI:
    """sessions_path: the WebSocket sessions' SQLite file shared by the API workers (None: in memory); worker,
    replica: sent as the `X-Csmserve-Worker` / `X-Csmserve-Replica` response headers."""
    config = config or ServerConfig()
    owns_store, owns_csm = store is None, csm is None and load is not None
    if store is None:
        store = open_voice_store(config.voices_db, config.voices_db_timeout_s)
    state = ServerState(csm, config, store, sessions_path)
    state.headers = [(b"x-csmserve-worker", str(worker).encode())] if worker is not None else []
    if replica is not None:
        state.headers.append((b"x-csmserve-replica", replica.encode()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader, csm = load, state.csm
        if loader is None and csm is not None and not state.ready:
            def loader() -> CSM:
                _ = csm.client  # CSM starts its engine on first use
                return csm
        task = asyncio.create_task(_load(state, loader)) if loader is not None else None
        _bind(state.csm)
        state.lead.start()
        watch = asyncio.create_task(_watch_engine(state))
        try:
            yield
        finally:
            state.lead.stop()
            watch.cancel()
            if task is not None:
                task.cancel()
            if owns_csm and state.csm is not None:
                await asyncio.to_thread(state.csm.close)
            if owns_store:
                state.store.close()

    app = FastAPI(title="csmserve", version="0.1.0", lifespan=lifespan, responses=openapi.RESPONSES,
                  description="OpenAI-compatible streaming speech for Sesame CSM-1B. See docs/api.md.")
    app.state.server = state
    errors.install(app)
    openapi.install(app)
    for module in (speech, voices, models, adapters, ws):
        app.include_router(module.router)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:  # the page to try voices and conversations; its files under /static
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(OriginMiddleware, allowed=config.cors_origins)  # inside the guard: its 403s are counted
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_error=state.metrics.error, body_timeout_s=config.body_timeout_s,
                       body_min_rate=config.body_min_rate, headers=state.headers,
                       max_header_bytes=config.max_header_bytes)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


STATIC_DIR = Path(__file__).parent / "static"


def _bind(csm: CSM | None) -> None:
    """An engine in another process delivers on this event loop (never starts an in-process engine)."""
    bind = getattr(getattr(csm, "_client", None), "bind", None)
    if bind is not None:
        bind(asyncio.get_running_loop())


async def _load(state: ServerState, load: Callable[[], CSM]) -> None:
    try:
        csm = await asyncio.to_thread(load)
        _bind(csm)
        state.csm = csm
        log.info("model %s loaded; ready", state.config.model_name)
    except (ValueError, RuntimeError, OSError) as e:  # no such model, offline, gated, disk full: why and what to do
        from csmserve.models.loader import ModelUnavailableError

        if not isinstance(e, (ModelUnavailableError, ValueError)):
            log.exception("loading the model failed; /ready stays 503")
        else:
            log.error("loading the model failed: %s; /ready stays 503", " ".join(str(e).split()))
    except Exception:
        log.exception("loading the model failed; /ready stays 503")


async def _watch_engine(state: ServerState) -> None:
    """An engine process's stall logged when it starts and ends, probed or not (ServerState.engine_stalled)."""
    while True:
        await asyncio.sleep(min(1.0, state.config.engine_stall_s / 4))
        state.engine_stalled()


_PROBES = ("/health", "/ready")  # their 503 is the server's state (loading, engine down), not a failed request


class GuardMiddleware:
    """The request head's size (max_header_bytes: h11 holds it only for a head that comes in several reads), API key
    on /v1 (HTTP; the WebSocket route checks its own), request body size and deadline (body_timeout_s + 1 s per
    body_min_rate bytes, else 408), error counts; `headers` added to every response."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, on_error: Callable[[int], None],
                 body_timeout_s: float | None = None, body_min_rate: int = 16384,
                 headers: list[tuple[bytes, bytes]] = (), max_header_bytes: int | None = None) -> None:
        self.app, self.api_key, self.max_body_bytes, self.on_error = app, api_key, max_body_bytes, on_error
        self.body_timeout_s, self.body_min_rate = body_timeout_s, body_min_rate
        self.headers = list(headers)
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.max_header_bytes is not None:
            head = (len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
                    + sum(len(k) + len(v) + 4 for k, v in scope["headers"]))  # "name: value\r\n"
            if head > self.max_header_bytes:
                return await self._reject(send, APIError(
                    400, f"the request's head is about {head} bytes; the limit is {self.max_header_bytes} "
                    "(--max-header-bytes)", "invalid_http"))
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            if not check_bearer(headers.get(b"authorization", b"").decode("latin-1"), self.api_key):
                return await self._reject(send, APIError(401, "invalid or missing API key; send "
                                                         "'Authorization: Bearer <key>'", "invalid_api_key"))
        too_large = APIError(413, f"request body is larger than {self.max_body_bytes} bytes", "request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._reject(send, too_large)
        loop = asyncio.get_running_loop()
        start = loop.time()
        seen, body_done, started = 0, False, False
        refused: APIError | None = None  # the body was cut short: this is the answer, whatever the app made of it

        async def limited_receive() -> Message:
            nonlocal seen, body_done, refused
            if body_done or self.body_timeout_s is None:
                message = await receive()
            else:
                left = start + self.body_timeout_s + seen / self.body_min_rate - loop.time()
                try:
                    message = await asyncio.wait_for(receive(), max(left, 0.0))
                except TimeoutError:
                    refused = APIError(408, f"the request body arrived too slowly ({seen} bytes in "
                                       f"{loop.time() - start:.0f} s)", "request_timeout")
                    raise refused from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_body_bytes:  # a chunked upload without Content-Length
                    refused = too_large
                    raise APIError(413, too_large.message, "request_too_large")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if refused is not None:
                    return await self._reject(send, refused)
                if message["status"] >= 400 and scope["path"] not in _PROBES:
                    self.on_error(message["status"])
                if self.headers:
                    message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            elif refused is not None:
                return
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except APIError as e:  # raised by limited_receive and not caught by the app
            if not started:
                await self._reject(send, refused or e)

    async def _reject(self, send: Send, error: APIError) -> None:
        self.on_error(error.status)
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *self.headers]  # which worker (and replica) refused it, as on every other response
        if error.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if error.status in (408, 413):  # the rest of the body is not read: the connection cannot be reused
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
