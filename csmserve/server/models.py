"""GET /v1/models, /v1/audio/models, /health, /ready, /metrics."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from csmserve.server.errors import APIError
from csmserve.server.state import ServerState

router = APIRouter()
# OpenAI's TTS model ids, listed so unmodified clients (Open WebUI, Pipecat) find a model they know
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
_STARTED = int(time.time())


def model_ids(state: ServerState) -> list[str]:
    return list(dict.fromkeys([state.config.model_name, "csm-1b", *OPENAI_MODELS]))


@router.get("/v1/models")
async def list_models(http: Request) -> dict:
    data = [{"id": m, "object": "model", "created": _STARTED, "owned_by": "csmserve"}
            for m in model_ids(http.app.state.server)]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, http: Request) -> dict:
    if model_id not in model_ids(http.app.state.server):
        raise APIError(404, f"model {model_id!r} not found", "model_not_found", "model")
    return {"id": model_id, "object": "model", "created": _STARTED, "owned_by": "csmserve"}


@router.get("/v1/audio/models")
async def audio_models(http: Request) -> dict:
    return {"models": [{"id": m} for m in model_ids(http.app.state.server)]}


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """200 while the process can serve (or is loading); 503 once the engine lost its device (restart it)."""
    fatal = http.app.state.server.engine_fatal()
    if fatal is not None:
        return APIError(503, f"the engine is down ({fatal}); restart the server", "engine_failed").response()
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(http: Request) -> JSONResponse:
    state: ServerState = http.app.state.server
    if not state.ready:
        return APIError(503, "model is loading", "model_not_ready").response()
    if state.engine_fatal() is not None:
        return APIError(503, f"the engine is down ({state.engine_fatal()})", "engine_failed").response()
    return JSONResponse({"status": "ready", "model": state.config.model_name})


@router.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(http.app.state.server.metrics.render(), media_type=CONTENT_TYPE_LATEST)
