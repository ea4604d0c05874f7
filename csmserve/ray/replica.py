"""One replica = one csmserve engine and csmserve's own FastAPI app, as a Ray Serve ingress deployment.

`build_replica(spec)` is the one place a replica makes its engine and app. By default
(RayConfig.replica_engine "process") the replica is split as `csmserve serve` is: it starts its own
engine-core process (server/processes.py EngineProcess: engine/core.py's loop alone in its interpreter,
its own output ring, Unix socket and authkey; slots sized to the replica's GPU share there) and its
HTTP side (the FastAPI app, audio encoding) attaches to it as an API worker does (CSM.attach over a
RemoteEngineClient). "thread": the engine loop on a thread of the replica's process (one GIL for both).

The deployment adds what Ray needs: `check_health` (fails once the engine lost its device or its process
is gone, so Ray replaces the replica), `record_routing_stats` (the router skips a failed replica at
once) and a report to the directory every RayConfig.report_interval_s (the application's /ready and
/metrics; the report names the replica's pid and its engine process's).
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray import serve

from csmserve.config import EngineConfig, ServerConfig
from csmserve.ray.edge import ReplicaEdge

if TYPE_CHECKING:
    from fastapi import FastAPI

    from csmserve.api import CSM
    from csmserve.server.processes import EngineProcess

log = logging.getLogger("csmserve.ray")
ENGINE_CLIENT_ID = 1  # the replica's HTTP side: the one client of its engine process


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
    # "module:function" (spec) -> a started ReplicaEngine (or a CSM: thread mode), instead of
    # build_engine (a custom engine; the tests' faults)
    csm_factory: str | None = None
    codec_dtype: str | None = None
    replica_engine: str = "process"  # RayConfig.replica_engine: "process" or "thread"


@dataclass
class ReplicaEngine:
    """What a replica serves with: its CSM and, in process mode, the engine-core process it started
    (with the run directory holding its socket)."""

    csm: CSM
    process: EngineProcess | None = None
    rundir: Path | None = None

    @property
    def pid(self) -> int | None:
        """The engine process's pid (None: the engine runs in the replica's own process)."""
        return None if self.process is None else self.process.pid

    def fatal(self) -> str | None:
        """Why the engine process is gone, if it is (the connection's loss says so too, a moment later)."""
        if self.process is not None and not self.process.alive:
            return f"the engine process (pid {self.process.pid}) exited (code {self.process.exitcode})"
        return None

    def close(self) -> None:
        """The connection, then the engine process, its ring file, socket and run directory."""
        try:
            self.csm.close()
        finally:
            if self.process is not None:
                self.process.stop()
            if self.rundir is not None:
                shutil.rmtree(self.rundir, ignore_errors=True)


def build_engine(spec: ReplicaSpec) -> ReplicaEngine:
    """The replica's engine, started (graphs captured) before Ray routes anything to it."""
    if spec.replica_engine == "thread":
        return ReplicaEngine(build_csm(spec))
    return start_engine_process(spec)


def start_engine_process(spec: ReplicaSpec) -> ReplicaEngine:
    """The replica's own engine-core process, ready, and the replica's CSM attached to it. The child
    inherits the actor's environment (CUDA_VISIBLE_DEVICES: the replica's GPU) and sizes its slots to
    spec.gpu_share of that GPU; it exits if this process dies (EngineSpec.parent_pid)."""
    from csmserve.server.processes import EngineProcess, attach_engine, engine_spec, load_engine_model, new_rundir

    rundir = new_rundir()
    espec = engine_spec(spec.model, spec.device, spec.dtype, spec.codec, spec.codec_dtype, spec.engine,
                        spec.log_level, rundir)
    process = EngineProcess(espec, functools.partial(load_engine_model, gpu_share=spec.gpu_share))
    try:
        process.start()
        process.wait_ready()
        csm = attach_engine(espec.address, espec.authkey, ENGINE_CLIENT_ID, timeout=60)
    except BaseException:
        process.stop()
        shutil.rmtree(rundir, ignore_errors=True)
        raise
    log.info("replica engine process %d ready (%s)", process.pid, espec.address)
    return ReplicaEngine(csm, process, rundir)


def build_csm(spec: ReplicaSpec) -> CSM:
    """The engine on a thread of this process (replica_engine "thread"), started."""
    from csmserve.server.processes import load_engine_model

    csm = load_engine_model(spec, spec.gpu_share)  # ReplicaSpec has every field of an EngineSpec it reads
    _ = csm.client
    return csm


def build_replica(spec: ReplicaSpec) -> tuple[ReplicaEngine, FastAPI]:
    from csmserve.server import create_app

    if spec.csm_factory:
        module, _, name = spec.csm_factory.partition(":")
        engine = getattr(importlib.import_module(module), name)(spec)
        engine = engine if isinstance(engine, ReplicaEngine) else ReplicaEngine(engine)
    else:
        engine = build_engine(spec)
    try:
        return engine, create_app(engine.csm, spec.server)
    except BaseException:
        engine.close()
        raise


@serve.deployment(name="CSMServe")
@serve.ingress()  # the app is the replica's own: __serve_build_asgi_app__
class CSMServeReplica:
    def __init__(self, spec: ReplicaSpec, directory: Any, report_interval_s: float = 0.5) -> None:
        logging.getLogger("csmserve").setLevel(spec.log_level.upper())
        self.replica = serve.get_replica_context().replica_tag
        self.engine, app = build_replica(spec)
        self.csm = self.engine.csm
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
        fatal = self.fatal()
        if fatal is not None:
            raise RuntimeError(f"csmserve replica {self.replica}: the engine is down ({fatal})")

    async def record_routing_stats(self) -> dict:
        self._start_reporting()
        return {"fatal": self.fatal() is not None}

    def fatal(self) -> str | None:
        """Why the engine is down: it lost its device, its process is gone (or the connection to it)."""
        return self.state.engine_fatal() or self.engine.fatal()

    async def __del__(self) -> None:  # Ray awaits it when it stops the replica
        if self._reporter is not None:
            self._reporter.cancel()
        try:
            await self.directory.forget.remote(self.replica)  # /ready stops counting it now, not in 4 reports
        except Exception:
            pass
        await asyncio.to_thread(self.engine.close)  # and in process mode the engine process, its files

    # ---- the directory
    def _start_reporting(self) -> None:
        if self._reporter is None or self._reporter.done():
            try:
                self._reporter = asyncio.get_running_loop().create_task(self._report_loop())
            except RuntimeError:  # constructed off the event loop: check_health starts it
                pass

    def report(self) -> dict:
        """This replica's state as the directory keeps it."""
        s, fatal = self.state, self.fatal()
        return {"ready": s.ready and fatal is None, "fatal": fatal, "active": s.active,
                "pid": os.getpid(), "engine_pid": self.engine.pid, "metrics": s.metrics.render().decode()}

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
