"""GET /v1/models, /v1/audio/models, /health, /ready, /metrics. The models: the base under each of its names
(ServerConfig.base_models) and each LoRA adapter served, as vLLM lists them (`parent`: the base, `root`: its path)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from csmserve.server.errors import APIError
from csmserve.server.state import ServerState

router = APIRouter()
_STARTED = int(time.time())


async def model_objects(state: ServerState) -> list[dict]:
    """OpenAI's model objects: the base under each of its names, then every adapter served (parent: the base)."""
    base = [{"id": m, "object": "model", "created": _STARTED, "owned_by": "csmserve"} for m in state.config.base_models]
    adapters = [{"id": name, "object": "model", "created": _STARTED, "owned_by": "csmserve",
                 "parent": state.config.model_name, "root": a.get("path") or name, "rank": a.get("rank")}
                for name, a in sorted((await state.adapters()).items())]
    return base + adapters


@router.get("/v1/models")
async def list_models(http: Request) -> dict:
    return {"object": "list", "data": await model_objects(http.app.state.server)}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, http: Request) -> dict:
    found = next((m for m in await model_objects(http.app.state.server) if m["id"] == model_id), None)
    if found is None:
        raise APIError(404, f"model {model_id!r} not found", "model_not_found", "model")
    return found


@router.get("/v1/audio/models")
async def audio_models(http: Request) -> dict:
    return {"models": [{"id": m["id"]} for m in await model_objects(http.app.state.server)]}


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """200 while the process can serve (or is loading); 503 once the engine lost its device (restart it), and while
    the engine process sends nothing for --engine-stall-s (hung: restart it if it stays so)."""
    state: ServerState = http.app.state.server
    fatal = state.engine_fatal()
    if fatal is not None:
        return APIError(503, f"the engine is down ({fatal}); restart the server", "engine_failed").response()
    silent = state.engine_stalled()
    if silent is not None:
        return _stalled(silent).response()
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(http: Request) -> JSONResponse:
    state: ServerState = http.app.state.server
    if not state.ready:
        return APIError(503, "model is loading", "model_not_ready").response()
    if state.engine_fatal() is not None:
        return APIError(503, f"the engine is down ({state.engine_fatal()})", "engine_failed").response()
    silent = state.engine_stalled()
    if silent is not None:
        return _stalled(silent).response()
    return JSONResponse({"status": "ready", "model": state.config.model_name})


def _stalled(silent: float) -> APIError:
    return APIError(503, f"the engine process has sent nothing for {silent:.0f} s (hung?); restart the server if "
                    "it stays so", "engine_stalled")


@router.get("/metrics")
async def metrics(http: Request) -> Response:
    state: ServerState = http.app.state.server
    try:  # the adapters' series: those served now (an unloaded adapter's are gone)
        adapters = await state.adapters()
    except Exception:  # noqa: BLE001 - the engine busy or gone: the rest of the metrics still answer
        adapters = {}
    return Response(state.metrics.render(adapters), media_type=CONTENT_TYPE_LATEST)
