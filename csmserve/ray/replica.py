"""One replica = one whole `csmserve serve` unit, as a Ray Serve deployment (`CSMServe`).

The actor starts what `csmserve serve`'s parent starts (server/processes.py `Supervisor`: the engine-core
process, slots sized to the replica's GPU share, and its API workers) on a port of its own, which HAProxy
connects to. The actor is on the control path only (no chunk passes through it): it restarts exiting workers,
answers `check_health` and `record_autoscaling_stats`, and every RayConfig.report_interval_s reports its
address, state, active streams, pids and Prometheus text to the directory (docs/scale-out.md).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
from typing import Any

from ray import serve

from csmserve.server.processes import ServeSpec, Supervisor, default_api_workers

log = logging.getLogger("csmserve.ray")
POLL_S = 0.2  # how often the actor looks at its processes (as `csmserve serve`'s parent does)
_ACTIVE = re.compile(rb"^csmserve:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def active_streams(metrics: bytes) -> int:
    """Requests the engine holds (running, idle between segments, waiting for a slot), from its gauges."""
    return int(sum(float(v) for v in _ACTIVE.findall(metrics)))


def replica_workers(spec: ServeSpec, cpus: float) -> int:
    """API workers of a replica: --api-workers, else as `csmserve serve` would on the replica's share of its
    node (its GPU share of the node's GPUs, or without a GPU its CPUs): every core of that share but three."""
    if spec.server.api_workers:
        return spec.server.api_workers
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    res = next((n["Resources"] for n in ray.nodes() if n.get("NodeID") == node_id), {})
    node_cpus = res.get("CPU") or os.cpu_count() or 1
    gpus = res.get("GPU") or 0
    share = spec.gpu_share / gpus if spec.gpu_share and gpus else cpus / node_cpus
    return default_api_workers(int(node_cpus * min(1.0, share)))


@serve.deployment(name="CSMServe")  # graceful_shutdown_timeout_s: app.replica_options, from --shutdown-timeout-s
class CSMServeReplica:
    async def __init__(self, spec: ServeSpec, directory: Any, report_interval_s: float = 0.5,
                       cpus: float = 1.0) -> None:
        import httpx
        import ray

        logging.getLogger("csmserve").setLevel(spec.log_level.upper())
        self.replica = serve.get_replica_context().replica_tag
        workers = replica_workers(spec, cpus)
        server = dataclasses.replace(spec.server, host="0.0.0.0", port=0, api_workers=workers)
        self.unit = Supervisor(dataclasses.replace(spec, server=server, replica=self.replica), workers)
        self.host = ray.util.get_node_ip_address()
        self.directory, self.report_interval_s = directory, report_interval_s
        self.metrics, self.active = b"", 0
        self._task: asyncio.Task | None = None
        # a connection per scrape: one kept open would count on its worker, and the dispatch (fewest open
        # connections) would keep new clients off that worker
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.unit.port}", timeout=10,
                                        limits=httpx.Limits(max_keepalive_connections=0))
        try:
            self.unit.start()
            await self._until_ready()
        except BaseException:
            await self.client.aclose()
            await asyncio.to_thread(self.unit.shutdown)
            raise
        self._start()
        log.info("replica %s ready: %s, %d API workers on %s:%d", self.replica, spec.model, workers, self.host,
                 self.unit.port)

    async def _until_ready(self) -> None:
        """Until the engine is up and a worker answers /ready 200 (RuntimeError if the unit fails first)."""
        while True:
            self.unit.check()
            if (fatal := self.unit.fatal()) is not None:
                raise RuntimeError(f"csmserve replica {self.replica} failed to start: {fatal}")
            if self.unit.engine_ready:
                try:
                    if (await self.client.get("/ready")).status_code == 200:
                        return
                except Exception:  # noqa: BLE001 - the workers still starting
                    pass
            await asyncio.sleep(POLL_S)

    # ---- what Ray calls
    async def check_health(self) -> None:
        self._start()
        if (fatal := self.unit.fatal()) is not None:
            raise RuntimeError(f"csmserve replica {self.replica}: {fatal}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray's autoscaler (autoscale.py): the streams this replica's engine holds."""
        return {"active": float(self.active)}

    async def __del__(self) -> None:  # Ray awaits it when it stops the replica
        if self._task is not None:
            self._task.cancel()
        try:
            await self.directory.forget.remote(self.replica)  # the ingresses stop routing here at their next look
        except Exception:  # noqa: BLE001
            pass
        # open streams end first (scale-down), for --shutdown-timeout-s at most; then the unit's own stop cuts them
        deadline = asyncio.get_running_loop().time() + self.unit.spec.server.shutdown_timeout_s
        while self.active > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.report_interval_s)
            await self._scrape()
        await self.client.aclose()
        await asyncio.to_thread(self.unit.shutdown)

    # ---- the unit and the directory
    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_report = 0.0
        while True:
            self.unit.check()
            if loop.time() >= next_report:
                next_report = loop.time() + self.report_interval_s
                await self._scrape()
                try:
                    await self.directory.report.remote(self.replica, self.report())
                except Exception as e:  # noqa: BLE001 - the directory restarting: the next report goes through
                    log.warning("replica %s: report to the directory failed: %s", self.replica, e)
            await asyncio.sleep(POLL_S)

    async def _scrape(self) -> None:
        try:
            r = await self.client.get("/metrics")
            if r.status_code == 200:
                self.metrics = r.content
                self.active = active_streams(self.metrics)
        except Exception:  # noqa: BLE001 - workers restarting: the last numbers until they are back
            pass

    def report(self) -> dict:
        """This replica as the directory keeps it (and the ingresses route by)."""
        fatal = self.unit.fatal()
        # not the last scrape's success: a worker slow to answer /metrics under load is not a reason to take the
        # replica out of HAProxy (its own health checks judge the workers)
        return {"ready": self.unit.engine_ready and fatal is None, "fatal": fatal,
                "host": self.host, "port": self.unit.port, "active": self.active, "pid": os.getpid(),
                "engine_pid": self.unit.engine.pid, "worker_pids": self.unit.worker_pids,
                "metrics": self.metrics.decode(errors="replace")}
