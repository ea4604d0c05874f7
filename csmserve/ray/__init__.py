"""csmserve on Ray Serve: replicas of the whole server behind HAProxy (docs/scale-out.md).

    csmserve serve --ray --num-replicas 2 --gpus-per-replica 0.5 --max-slots 512
    serve run csmserve.ray:app                       # from CSMSERVE_* variables
    serve run csmserve.ray:build_app model=sesame/csm-1b min_replicas=1 max_replicas=4 max_slots=512

The files: docs/structure.md. Needs `pip install 'csmserve[ray]'`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["application", "build_app", "ServeSpec", "app"]


def __getattr__(name: str) -> Any:
    if name in ("application", "build_app"):
        from csmserve.ray import app as _app

        return getattr(_app, name)
    if name == "ServeSpec":
        from csmserve.server.processes import ServeSpec

        return ServeSpec
    if name == "app":  # `serve run csmserve.ray:app`: everything from CSMSERVE_* variables and the defaults
        from csmserve.ray.app import build_app

        return build_app({})
    raise AttributeError(f"module 'csmserve.ray' has no attribute {name!r}")
