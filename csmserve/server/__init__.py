"""FastAPI server: OpenAI speech routes, voices, WebSocket, metrics, health. `create_app(csm, config)`.

`create_app` is imported on first use, so `csmserve.server.flags` (the `serve` flags) loads no server module."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["create_app"]

if TYPE_CHECKING:
    from csmserve.server.app import create_app


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from csmserve.server.app import create_app

        return create_app
    raise AttributeError(f"module 'csmserve.server' has no attribute {name!r}")
