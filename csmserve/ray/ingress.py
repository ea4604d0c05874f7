"""The ingress: a Ray Serve deployment (`CSMServeIngress`, CPU only, at most one per node) running HAProxy on
`--host:--port` (haproxy.py), reloaded in place when the directory's set of ready replicas changes.

The actor answers `/ready`, `/metrics` and `/-/healthz` on a small local port HAProxy routes them to (per
scrape, not per chunk; docs/scale-out.md). Ray's `check_health` fails when HAProxy is gone.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from csmserve.config import RayConfig, ServerConfig
from csmserve.ray.directory import merge_metrics, readiness
from csmserve.ray.haproxy import Frontend, HAProxy, Server, binary, haproxy_threads, render

log = logging.getLogger("csmserve.ray")
LOW_MAXCONN = 8192  # below it (a low open-file limit) the ingress says so: 2,048 streams take 4,096 sockets
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 501: "Not Implemented", 503: "Service Unavailable"}
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # answered here: --ray's adapters are --lora


@dataclass(frozen=True)
class IngressSpec:
    """What each ingress builds its HAProxy from (only these: a change of any other flag leaves it running)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "sesame/csm-1b"
    models: tuple[str, ...] = ServerConfig().base_models  # `model` values meaning the base (the replicas' own)
    load_factor: float = 1.25
    body_bytes: int = 256 << 10
    request_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    report_interval_s: float = 0.5
    threads: int = 0  # HAProxy's (haproxy_threads of --ingress-cpus); 0: of no reservation (MAX_THREADS)

    @classmethod
    def of(cls, server: ServerConfig, cfg: RayConfig) -> IngressSpec:
        return cls(server.host, server.port, server.model_name, server.base_models, cfg.affinity_load_factor,
                   cfg.ingress_body_bytes, server.header_timeout_s + server.body_timeout_s, server.keep_alive_s,
                   cfg.report_interval_s, haproxy_threads(cfg.ingress_cpus))


def frontend(spec: IngressSpec, control_port: int) -> Frontend:
    from csmserve.voices import OPENAI_VOICES

    return Frontend(spec.host, spec.port, control_port, models=spec.models,
                    aliases=OPENAI_VOICES, load_factor=spec.load_factor, body_bytes=spec.body_bytes,
                    request_timeout_s=spec.request_timeout_s, keep_alive_s=spec.keep_alive_s,
                    threads=spec.threads or haproxy_threads(0.0))


def routable(reports: dict[str, dict]) -> tuple[Server, ...]:
    """The replicas to route to: ready, not failed, with a data port."""
    return tuple(sorted((Server(r, s["host"], int(s["port"])) for r, s in reports.items()
                         if s.get("ready") and not s.get("fatal") and s.get("host") and s.get("port")),
                        key=lambda s: s.name))


@serve.deployment(name="CSMServeIngress", max_replicas_per_node=1, logging_config={"enable_access_log": False})
class CSMServeIngress:
    async def __init__(self, spec: IngressSpec, directory: Any, replicas: Any = None) -> None:
        """replicas: the CSMServe deployment's handle (never called: it makes the replicas part of the app)."""
        self.spec, self.directory = spec, directory
        self.workdir = Path(tempfile.mkdtemp(prefix=f"csmserve-ingress-{os.getpid()}-"))
        self.control = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        self.frontend = frontend(spec, self.control.sockets[0].getsockname()[1])
        self.proxy = HAProxy(binary(), self.workdir)
        self.servers = routable(await self._reports())
        try:
            # started from this (the actor's event loop) thread: HAProxy's parent-death signal follows it
            self.proxy.start(render(self.frontend, self.servers), spec.host, spec.port)
        except BaseException:
            self.control.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self._task = asyncio.get_running_loop().create_task(self._watch())
        log.info("csmserve ingress: HAProxy (pid %d) on %s:%d, %d replicas, %d connections at most",
                 self.proxy.process.pid, spec.host, spec.port, len(self.servers), self.frontend.maxconn)
        if self.frontend.maxconn < LOW_MAXCONN:  # each stream is two of HAProxy's sockets, all in one process
            log.warning("csmserve ingress: HAProxy can hold %d connections only (the open-file limit, ulimit -n, "
                        "allows %d files): raise the limit of the nodes' Ray", self.frontend.maxconn,
                        2 * self.frontend.maxconn + 256)

    async def _reports(self) -> dict[str, dict]:
        try:
            return dict(await self.directory.snapshot.remote())
        except Exception as e:  # noqa: BLE001 - the directory restarting: nothing new this time
            log.warning("ingress: the directory did not answer: %s", e)
            return {}

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.spec.report_interval_s)
            servers = routable(await self._reports())
            if servers != self.servers:
                try:
                    await asyncio.to_thread(self.proxy.reload, render(self.frontend, servers))
                    log.info("ingress: routing to %s", ", ".join(f"{s.name} ({s.host}:{s.port})" for s in servers))
                    self.servers = servers
                except Exception:  # noqa: BLE001 - keep the config HAProxy has; try again at the next look
                    log.exception("ingress: reloading HAProxy failed")

    # ---- what Ray calls
    async def check_health(self) -> None:
        if not self.proxy.alive:
            raise RuntimeError(f"HAProxy exited: {self.proxy.log_tail()}")
        if self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def __call__(self, request) -> Any:
        """A request that came through Ray Serve's own proxy (`serve run` keeps it on): not the way in."""
        from starlette.responses import JSONResponse

        s = self.spec
        return JSONResponse({"error": {"message": f"csmserve listens on {s.host}:{s.port} (its HAProxy ingress), "
                                       "not on Ray Serve's proxy", "type": "invalid_request_error", "param": None,
                                       "code": "wrong_port"}}, status_code=404)

    async def __del__(self) -> None:
        self._task.cancel()
        self.control.close()
        await asyncio.to_thread(self.proxy.stop)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- the control port: /ready, /metrics, /-/healthz (HAProxy sends them here)
    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            method, target = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[:2]
            status, ctype, body = await self.respond(method, target.split("?", 1)[0])
            writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\ncontent-type: {ctype}\r\n"
                         f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()

    async def respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        from csmserve.server.errors import APIError

        def error(e: APIError, **extra) -> tuple[int, str, bytes]:
            return e.status, "application/json", json.dumps({**e.body(), **extra}).encode()

        if path in ADAPTER_ROUTES:  # (HAProxy sends them here, whatever the method)
            return error(APIError(
                501, f"{path}: with --ray, LoRA adapters are given at start (csmserve serve --ray --lora NAME=PATH): "
                "every replica loads them, also those Ray starts later; one replica loading at run time would "
                "serve an adapter the others do not", "not_supported_with_ray", type="invalid_request_error"))
        if method not in ("GET", "HEAD"):
            return error(APIError(405, f"{method} {path}: use GET"))
        if path == "/-/healthz":
            return (200, "text/plain", b"success") if self.servers else (503, "text/plain", b"no replica ready")
        reports = await self._reports()
        if path == "/metrics":
            text = merge_metrics({r: s.get("metrics", "") for r, s in reports.items()})
            return 200, "text/plain; version=0.0.4; charset=utf-8", text.encode()
        if path != "/ready":
            return error(APIError(404, f"no route {path}"))
        routed = {s.name for s in self.servers}
        for r, s in reports.items():  # ready but not in this HAProxy's config yet: still loading, for this ingress
            if s.get("ready") and r not in routed:
                reports[r] = {**s, "ready": False}
        r = readiness(reports)
        if r["ready"] == 0:
            return error(APIError(503, f"no replica is ready ({r['total']} reporting: {r['replicas']})",
                                  "no_replica_ready"), replicas=r)
        body = {"status": "ready", "model": self.spec.model_name, "replicas": r}
        return 200, "application/json", json.dumps(body).encode()
