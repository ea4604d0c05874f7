"""The OpenAPI document (/openapi.json) where FastAPI cannot infer it: errors are 400 in OpenAI's shape
(never 422), the speech 200 is audio or SSE, and JSON bodies parsed by hand (schemas.parse_body) are
still documented. Generated clients and schemathesis read this."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from csmserve.audio import MEDIA_TYPES

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    """Every error, whatever the status: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


_ERROR = {"description": "An error in OpenAI's shape (`code` is never null)", "model": ErrorResponse}
# every route: any status but 200 is an error of this shape
RESPONSES: dict[int | str, dict[str, Any]] = {"default": _ERROR}
SPEECH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The speech as it is generated: audio in `response_format` (chunked), or with "
                         "`stream_format: sse` `speech.audio.delta` / `speech.audio.done` events",
          "content": {**{m: {"schema": {"type": "string", "format": "binary"}}
                         for m in dict.fromkeys(MEDIA_TYPES.values())},
                      "text/event-stream": {"schema": {"type": "string"}}}},
    400: {**_ERROR, "description": "A bad field (`param` names it) or a body that is not JSON"},
}
_MODELS: dict[str, type[BaseModel]] = {}  # bodies parsed by hand, added to components


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra for a route that parses `model` from its body itself."""
    _MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, model in _MODELS.items():
        schema = model.model_json_schema(ref_template=_REF, mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    for path in doc.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            if responses.pop("422", None) is not None or "requestBody" in op:
                responses.setdefault("400", {"description": "A bad field (`param` names it)", "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if (metrics := doc.get("paths", {}).get("/metrics", {}).get("get")) is not None:  # Prometheus' text, not JSON
        metrics["responses"]["200"]["content"] = {"text/plain; version=0.0.4": {"schema": {"type": "string"}}}
    return doc
