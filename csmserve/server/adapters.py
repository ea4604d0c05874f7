"""LoRA adapters at run time, vLLM's routes: POST /v1/load_lora_adapter `{"lora_name", "lora_path"}` and
POST /v1/unload_lora_adapter `{"lora_name"}`. Other streams go on (an adapter is read off the engine's loop).

Trust: `lora_path` is read on the server's machine. The route is off unless the server was started with
--lora-dir DIR, and then reads only directories under DIR (one that resolves outside it, through `..` or a
symlink, is refused before anything is read, so no caller learns what exists elsewhere).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Request

from csmserve.config import ServerConfig
from csmserve.engine.adapters import AdapterExistsError, AdapterLimitError, UnknownAdapterError
from csmserve.server import openapi
from csmserve.server.errors import APIError, bad_request
from csmserve.server.schemas import LoadLoraAdapter, UnloadLoraAdapter, check_json_type, parse_body
from csmserve.server.state import ServerState

router = APIRouter()
T = TypeVar("T", LoadLoraAdapter, UnloadLoraAdapter)


def adapter_path(config: ServerConfig, lora_path: str) -> str:
    """lora_path -> the real path of a directory under --lora-dir (403 when the route is off or it is outside)."""
    if config.lora_dir is None:
        raise APIError(403, "loading adapters at run time is off on this server: start it with --lora-dir DIR (the "
                       "directory adapters are read from), or give them at start with --lora NAME=PATH",
                       "lora_loading_disabled", "lora_path")
    root = Path(config.lora_dir).expanduser().resolve()
    if "\0" in lora_path:
        raise bad_request("'lora_path' has a NUL character", "lora_path", "invalid_path")
    try:
        path = (root / lora_path).resolve()  # an absolute lora_path stays itself; `~` is a name like any other
    except (OSError, RuntimeError) as e:  # a link loop, a name too long
        raise bad_request(f"lora_path {lora_path!r} cannot be resolved ({e})", "lora_path", "invalid_path") from None
    if not path.is_relative_to(root):
        raise APIError(403, f"lora_path {lora_path!r} is outside the server's --lora-dir", "path_not_allowed",
                       "lora_path")
    return str(path)


async def _adapter_request(http: Request, schema: type[T]) -> tuple[ServerState, T]:
    """The request's state and its JSON body, once the server serves adapters and the body names a valid one."""
    state: ServerState = http.app.state.server
    check_json_type(http.headers.get("content-type"))
    body = await parse_body(await http.body(), schema)
    state.require_ready()
    if not state.lora:
        raise bad_request("this server serves no LoRA adapters: start it with --max-loras N (or --lora NAME=PATH)",
                          "lora_name", "lora_disabled")
    try:
        state.config.check_adapter_name(body.lora_name)
    except ValueError as e:
        raise bad_request(str(e), "lora_name", "invalid_adapter_name") from None
    return state, body


@router.post("/v1/load_lora_adapter", openapi_extra=openapi.json_body(LoadLoraAdapter))
async def load_lora_adapter(http: Request) -> dict:
    """Serve the PEFT / unsloth adapter directory `lora_path` as `lora_name` (a request's `model`) from now on."""
    state, body = await _adapter_request(http, LoadLoraAdapter)
    path = adapter_path(state.config, body.lora_path)
    csm = state.csm
    try:
        info = await asyncio.to_thread(csm.load_adapter, body.lora_name, path)
    except AdapterExistsError as e:
        raise APIError(409, str(e), "adapter_exists", "lora_name") from None
    except AdapterLimitError as e:  # --max-cpu-loras
        raise APIError(409, f"{e} (--max-cpu-loras)", "too_many_adapters", "lora_name") from None
    except (ValueError, OSError) as e:  # LoraError: another base, missing / corrupt files, DoRA, a rank over the
        # pool's ...; OSError: a path the system refuses (a name too long)
        raise bad_request(" ".join(str(e).split()), "lora_path", "invalid_adapter") from None
    except FutureTimeout:
        raise APIError(504, "the engine did not finish loading the adapter in time", "engine_timeout") from None
    return {"id": body.lora_name, "object": "model", "parent": state.config.model_name, "root": info.get("path"),
            "rank": info.get("rank"), "bytes": info.get("bytes")}


@router.post("/v1/unload_lora_adapter", openapi_extra=openapi.json_body(UnloadLoraAdapter))
async def unload_lora_adapter(http: Request) -> dict:
    """Stop serving `lora_name`: new requests naming it get 404 at once; those in flight finish with it."""
    state, body = await _adapter_request(http, UnloadLoraAdapter)
    try:
        await asyncio.to_thread(state.csm.unload_adapter, body.lora_name)
    except UnknownAdapterError:
        raise APIError(404, f"adapter {body.lora_name!r} is not loaded (GET /v1/models lists the adapters)",
                       "model_not_found", "lora_name") from None
    except FutureTimeout:
        raise APIError(504, "the engine did not answer in time", "engine_timeout") from None
    return {"id": body.lora_name, "object": "model", "deleted": True}
