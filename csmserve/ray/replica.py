"""One replica = one csmserve engine and csmserve's own FastAPI app, as a Ray Serve ingress deployment.

`build_replica(spec)` is the one place a replica makes its CSM and app (the engine runs on a thread of
the replica's process today; an engine-core subprocess would be built here instead). The deployment
adds what Ray needs: `check_health` (fails once the engine lost its device, so Ray replaces the
replica), `record_routing_stats` (the router skips a failed replica at once) and a report to the
directory every RayConfig.report_interval_s (the application's /ready and /metrics).
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray import serve

from csmserve.config import EngineConfig, ServerConfig
from csmserve.ray.edge import ReplicaEdge

if TYPE_CHECKING:
    from fastapi import FastAPI

    from csmserve.api import CSM

log = logging.getLogger("csmserve.ray")


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica builds: the model and its configs (the same flags as `csmserve serve`)."""

    model: str = "sesame/csm-1b"
    device: str | None = None
    dtype: str | None = None
    codec: str | None = None
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    gpu_share: float = 1.0  # the fraction of a GPU this replica has: sizes its slots when max_slots is None
    log_level: str = "info"
    # "module:function" (spec) -> a started CSM, instead of build_csm (a custom engine; the tests' faults)
    csm_factory: str | None = None


def build_csm(spec: ReplicaSpec) -> CSM:
    """The replica's engine, started (graphs captured) before Ray routes anything to it."""
    from csmserve.api import CSM

    csm = CSM(spec.model, device=spec.device, dtype=spec.dtype, codec=spec.codec, engine=True,
              engine_config=spec.engine)
    if csm.device.type == "cuda" and spec.gpu_share < 1 and spec.engine.max_slots is None:
        csm.engine_config = dataclasses.replace(spec.engine, max_slots=slots_in_share(csm, spec))
    _ = csm.client
    return csm


def slots_in_share(csm: CSM, spec: ReplicaSpec) -> int:
    """Slots that fit in this replica's share of the GPU (replicas sharing one must not each size
    against all of its free memory): share x total, less what this process holds (the weights)."""
    import torch

    from csmserve.engine.prefix_cache import default_prefix_cache_bytes
    from csmserve.engine.slots import size_slots

    total = torch.cuda.mem_get_info(csm.device)[1]
    free = int(total * spec.gpu_share) - torch.cuda.memory_allocated(csm.device)
    cache = spec.engine.prefix_cache_bytes
    cache = default_prefix_cache_bytes("cuda") if cache is None else cache
    return size_slots(csm.model, csm.mimi, spec.engine.max_seq_len, reserve_bytes=cache, free_bytes=max(0, free))


def build_replica(spec: ReplicaSpec) -> tuple[CSM, FastAPI]:
    from csmserve.server import create_app

    if spec.csm_factory:
        module, _, name = spec.csm_factory.partition(":")
        csm = getattr(importlib.import_module(module), name)(spec)
    else:
        csm = build_csm(spec)
    return csm, create_app(csm, spec.server)


@serve.deployment(name="CSMServe")
@serve.ingress()  # the app is the replica's own: __serve_build_asgi_app__
class CSMServeReplica:
    def __init__(self, spec: ReplicaSpec, directory: Any, report_interval_s: float = 0.5) -> None:
        logging.getLogger("csmserve").setLevel(spec.log_level.upper())
        self.replica = serve.get_replica_context().replica_tag
        self.csm, app = build_replica(spec)
        self.state = app.state.server
        self.directory, self.report_interval_s = directory, report_interval_s
        self._reporter: asyncio.Task | None = None
        self.edge = ReplicaEdge(app, self.replica, self.cluster)
        self._start_reporting()
        log.info("replica %s ready: %s", self.replica, spec.model)

    # ---- what Ray calls
    def __serve_build_asgi_app__(self) -> ReplicaEdge:
        return self.edge

    async def check_health(self) -> None:
        self._start_reporting()
        fatal = self.state.engine_fatal()
        if fatal is not None:
            raise RuntimeError(f"csmserve replica {self.replica}: the engine is down ({fatal})")

    async def record_routing_stats(self) -> dict:
        self._start_reporting()
        return {"fatal": self.state.engine_fatal() is not None}

    async def __del__(self) -> None:  # Ray awaits it when it stops the replica
        if self._reporter is not None:
            self._reporter.cancel()
        try:
            await self.directory.forget.remote(self.replica)  # /ready stops counting it now, not in 4 reports
        except Exception:
            pass
        await asyncio.to_thread(self.csm.close)

    # ---- the directory
    def _start_reporting(self) -> None:
        if self._reporter is None or self._reporter.done():
            try:
                self._reporter = asyncio.get_running_loop().create_task(self._report_loop())
            except RuntimeError:  # constructed off the event loop: check_health starts it
                pass

    def report(self) -> dict:
        """This replica's state as the directory keeps it."""
        s = self.state
        return {"ready": s.ready and s.engine_fatal() is None, "fatal": s.engine_fatal(), "active": s.active,
                "metrics": s.metrics.render().decode()}

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.directory.report.remote(self.replica, self.report())
            except Exception as e:  # the directory restarting: the next report goes through
                log.warning("replica %s: report to the directory failed: %s", self.replica, e)
            await asyncio.sleep(self.report_interval_s)

    async def cluster(self) -> dict[str, dict]:
        """Every replica's last report, this one's fresh."""
        try:
            reports = dict(await self.directory.snapshot.remote())
        except Exception as e:
            log.warning("replica %s: the directory did not answer: %s", self.replica, e)
            reports = {}
        reports[self.replica] = self.report()
        return reports
