"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every failure we answer."""
from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("csmserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


# the code of an error raised without one (never null in a response): by status
_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
          408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
          429: "too_many_requests", 500: "internal_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _CODES.get(status, "error")
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def check_bearer(authorization: str, api_key: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code, param)


def _param(loc: tuple) -> str | None:
    # ("body", "context", 0, "audio") -> "context[0].audio"
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "form") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def _is_type_tag(part: str) -> bool:
    # pydantic puts the union member in loc: ("voice", "str"), ("voice", "VoiceRef"), ("x", "function-after[...]")
    return part in ("str", "int", "float", "bool", "list", "dict", "none") or part[:1].isupper() or "[" in part


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    errors = exc.errors(include_input=False) if isinstance(exc, ValidationError) else exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _param(tuple(first.get("loc", ())))
    msg, kind = first.get("msg", "invalid value"), first.get("type")
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}",
                        "invalid_json")
    if kind == "missing":
        if param is None:  # FastAPI: no body at all
            return APIError(400, "the request body is missing; send a JSON object", "missing_required_parameter",
                            "body")
        return APIError(400, f"missing required parameter '{param}'", "missing_required_parameter", param)
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object", "invalid_json")
    return APIError(400, f"invalid value for '{param}': {msg}" if param else msg, "invalid_value", param)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own: 404/405 routing, 400 from the multipart parser (no boundary, bad framing)
        code = "invalid_multipart" if exc.status_code == 400 and "multipart" in str(exc.detail).lower() else None
        return APIError(exc.status_code, str(exc.detail), code).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # the client left while its body was being read: nobody reads this answer, nothing failed here
        return APIError(400, "the client closed the connection before its request body arrived",
                        "client_disconnected").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", "internal_error").response()
