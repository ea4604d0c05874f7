"""The Ray Serve application: `application(spec, ray_config)`, `build_app(args)` for `serve run`, and
`run_ray(args)` behind `csmserve serve --ray`.

    csmserve serve --ray --model dummy-tiny --device cpu --num-replicas 2
    serve run csmserve.ray:app                                   # CSMSERVE_* variables, defaults
    serve run csmserve.ray:build_app model=dummy-tiny device=cpu num_replicas=2
    serve.run(csmserve.ray.build_app({"model": "sesame/csm-1b", "min_replicas": 1, "max_replicas": 8,
                                      "max_slots": 512}))

Deployments: `CSMServe` (the replicas: the ingress, csmserve's FastAPI app in each) and
`CSMServeDirectory` (one, no CPU: the replicas' reports, for /ready and /metrics).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csmserve.config import RayConfig
from csmserve.server.flags import add_serve_parser, configs, ray_config
from csmserve.ray.replica import ReplicaSpec

if TYPE_CHECKING:
    from ray.serve import Application

log = logging.getLogger("csmserve.ray")
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "csmserve.ray.affinity.proxy_middlewares"
ROUTING_STATS_PERIOD_S = 0.5  # how soon the routers learn that a replica's engine failed
NO_SLOT_LIMIT = 4096  # max_ongoing_requests base when --max-slots is unset (sized from GPU memory)
GRPC_MAX_MESSAGE_BYTES = 256 << 20  # proxy <-> replica over gRPC, either way (ray_environment)


def spec_from_args(args: argparse.Namespace) -> tuple[ReplicaSpec, RayConfig]:
    """`csmserve serve` flags -> what each replica builds, and how Ray runs them."""
    server, engine = configs(args)
    ray_cfg = ray_config(args)
    share = ray_cfg.gpus_per_replica
    if share is None:
        share = 0.0 if (args.device or "").startswith("cpu") else 1.0
    spec = ReplicaSpec(model=args.model, device=args.device, dtype=args.dtype, codec=args.codec, server=server,
                       engine=engine, gpu_share=share, log_level=args.log_level,
                       codec_dtype=getattr(args, "codec_dtype", None), replica_engine=ray_cfg.replica_engine)
    return spec, ray_cfg


def deployment_options(spec: ReplicaSpec, cfg: RayConfig) -> dict[str, Any]:
    """The CSMServe deployment's Ray options (replicas, resources, limits, health checks, routing)."""
    from ray.serve.config import RequestRouterConfig

    from csmserve.ray.router import AffinityRouter

    slots, waiting = spec.engine.max_slots, spec.engine.max_waiting
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": spec.gpu_share},
        # Ray's default (5) would cap a replica far below its slots; past this Ray routes elsewhere
        "max_ongoing_requests": cfg.max_ongoing_requests or (slots or NO_SLOT_LIMIT) + waiting,
        "logging_config": {"log_level": spec.log_level.upper()},  # Serve's logs in the replicas, as --log-level
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=AffinityRouter, request_router_kwargs={"load_factor": cfg.affinity_load_factor},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=5.0),
    }
    if cfg.autoscaling:
        target = cfg.target_ongoing_requests
        if target is None:
            if slots is None:
                raise ValueError("autoscaling needs --max-slots (the target is 3/4 of it) or "
                                 "--target-ongoing-requests")
            target = max(1, math.ceil(0.75 * slots))
        lo = cfg.min_replicas if cfg.min_replicas is not None else 1
        hi = cfg.max_replicas if cfg.max_replicas is not None else max(lo, 1)
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target}
    else:
        opts["num_replicas"] = cfg.num_replicas
    return opts


def application(spec: ReplicaSpec, cfg: RayConfig = RayConfig()) -> Application:
    from csmserve.ray.directory import Directory
    from csmserve.ray.replica import CSMServeReplica

    directory = Directory.bind(cfg.report_interval_s)
    return CSMServeReplica.options(**deployment_options(spec, cfg)).bind(spec, directory, cfg.report_interval_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="csmserve")
    add_serve_parser(p.add_subparsers(dest="command"))
    return p


def parse_flags(args: dict[str, Any] | None = None) -> argparse.Namespace:
    """{"model": "dummy-tiny", "num_replicas": 2, ...} (flag names, `_` or `-`) -> the serve flags."""
    argv = ["serve"]
    for key, value in (args or {}).items():
        if value is None or key == "ray":
            continue
        value = ",".join(value) if isinstance(value, (list, tuple)) else value
        argv += ["--" + str(key).replace("_", "-"), str(value)]
    return _parser().parse_args(argv)


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder (`serve run csmserve.ray:build_app model=... num_replicas=2`):
    every `csmserve serve` flag by name; the rest from CSMSERVE_* variables and the defaults."""
    return application(*spec_from_args(parse_flags(args)))


def ensure_importable() -> None:
    """Ray's worker processes inherit this environment: make csmserve importable there as it is here."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def ray_environment(cfg: RayConfig) -> dict[str, str]:
    """The variables of the Ray instance csmserve starts (`serve --ray`, its tests and benchmarks): every Ray
    process inherits them, and Serve's proxy and replicas read theirs once, when they start. On a cluster
    they belong in the environment of `ray start` on every node (docs/scale-out.md)."""
    grpc = cfg.proxy_transport == "grpc"
    return {
        PROXY_CALLBACK_ENV: PROXY_CALLBACK,  # body-based affinity in every proxy
        "RAY_USAGE_STATS_ENABLED": "0",  # a local instance reports nothing anywhere
        # Ray starts its workers at nice 15: the proxy, the replicas and their engine processes would lose
        # the CPU to anything else on the node (`csmserve serve` runs at 0)
        "RAY_worker_niceness": "0",
        # proxy -> replica over gRPC, not a Ray streaming generator; with the router on the proxy's own
        # loop, a response message reaches the proxy's HTTP side without a thread hop (docs/scale-out.md)
        "RAY_SERVE_PROXY_USE_GRPC": "1" if grpc else "0",
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0" if grpc else "1",
        # a replica batches whatever ASGI messages it has queued into one gRPC message: a proxy that fell
        # behind a fast stream must not meet Ray's 4 MiB default
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES),
    }


def set_ray_environment(cfg: RayConfig) -> None:
    """ray_environment(cfg) into os.environ, before Ray starts; a variable already set wins."""
    for key, value in ray_environment(cfg).items():
        os.environ.setdefault(key, value)


def run_ray(args: argparse.Namespace) -> int:
    """`csmserve serve --ray`: a local Ray instance (or --ray-address), Serve's proxy on --host/--port."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec, cfg = spec_from_args(args)
    app = application(spec, cfg)
    import ray
    from ray import serve

    ensure_importable()
    set_ray_environment(cfg)  # the local instance's processes inherit it (a cluster's has its own)

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    try:
        if cfg.ray_address is None:
            ray.init(include_dashboard=False)
        else:
            ray.init(address=cfg.ray_address)
            log.info("joined a Ray cluster: its proxies and replicas have the environment of `ray start`, which "
                     "needs %s (routing by voice / conversation from the body: %s; headers and ?context_id= "
                     "route without it; the rest is --proxy-transport %s)",
                     " ".join(f"{k}={v}" for k, v in ray_environment(cfg).items() if k != "RAY_USAGE_STATS_ENABLED"),
                     PROXY_CALLBACK_ENV, cfg.proxy_transport)
        signal.signal(signal.SIGTERM, interrupt)  # a container's stop: as Ctrl-C (after ray.init: its handler aborts)
        serve.start(http_options={"host": spec.server.host, "port": spec.server.port})
        serve.run(app, name=cfg.app_name, route_prefix="/", blocking=False)
        log.info("csmserve on Ray Serve at http://%s:%d (%s)", spec.server.host, spec.server.port,
                 f"{cfg.min_replicas}-{cfg.max_replicas} replicas" if cfg.autoscaling
                 else f"{cfg.num_replicas} replicas")
        stop = threading.Event()  # Ctrl-C / SIGTERM (a container's stop): take the application down
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:  # before the handlers: while starting
        pass
    finally:
        log.info("stopping")
        if ray.is_initialized():
            try:
                if cfg.ray_address is None:
                    serve.shutdown()  # then the local instance goes with ray.shutdown
                else:
                    serve.delete(cfg.app_name)  # a cluster's: only our application
            finally:
                ray.shutdown()
    return 0
