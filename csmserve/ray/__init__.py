"""csmserve on Ray Serve: replicas of the engine behind one endpoint (docs/scale-out.md).

    csmserve serve --ray --num-replicas 2 --gpus-per-replica 0.5 --max-slots 512
    serve run csmserve.ray:app                       # from CSMSERVE_* variables
    serve run csmserve.ray:build_app model=sesame/csm-1b min_replicas=1 max_replicas=4 max_slots=512

app.py builds the application; replica.py is one replica (one engine, csmserve's FastAPI app as the
ingress); edge.py its ASGI additions (replica header, the application's /ready and /metrics);
directory.py the replicas' reports; router.py the request router (conversation / voice affinity under
a load bound); affinity.py the proxy middleware that takes the routing key from the body.
Needs `pip install 'csmserve[ray]'`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["application", "build_app", "ReplicaSpec", "app"]


def __getattr__(name: str) -> Any:
    if name in ("application", "build_app"):
        from csmserve.ray import app as _app

        return getattr(_app, name)
    if name == "ReplicaSpec":
        from csmserve.ray.replica import ReplicaSpec

        return ReplicaSpec
    if name == "app":  # `serve run csmserve.ray:app`: everything from CSMSERVE_* variables and the defaults
        from csmserve.ray.app import build_app

        return build_app({})
    raise AttributeError(f"module 'csmserve.ray' has no attribute {name!r}")
