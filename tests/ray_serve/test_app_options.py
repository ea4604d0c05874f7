"""From `csmserve serve` flags (or Serve's builder args, or the RayService manifest) to the deployments' Ray
options: replicas or autoscaling on the streams they hold, GPU shares, health checks, the ingress."""
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
import yaml  # noqa: E402

from csmserve.ray.app import (build_app, ingress_options, parse_flags, ray_environment, replica_options,  # noqa: E402
                              spec_from_args)
from csmserve.ray.autoscale import POLICY, active_streams, desired_replicas  # noqa: E402
from csmserve.ray.ingress import IngressSpec, routable  # noqa: E402
from csmserve.ray.replica import active_streams as engine_streams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def options(**flags) -> dict:
    return replica_options(*spec_from_args(parse_flags(flags)))


def test_fixed_replicas_with_fractional_gpus():
    o = options(model="dummy", num_replicas=2, gpus_per_replica=0.5, max_slots=256)
    assert o["num_replicas"] == 2 and "autoscaling_config" not in o
    assert o["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert o["health_check_period_s"] == 2.0 and "request_router_config" not in o  # requests never pass Serve


def test_autoscaling_on_the_streams_the_replicas_hold():
    o = options(model="dummy", min_replicas=1, max_replicas=8, max_slots=512)
    assert "num_replicas" not in o
    assert o["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 384,
                                       "policy": {"policy_function": POLICY}}
    o = options(model="dummy", max_replicas=3, target_ongoing_requests=100)
    assert o["autoscaling_config"]["target_ongoing_requests"] == 100 and o["autoscaling_config"]["min_replicas"] == 1
    with pytest.raises(ValueError, match="max-slots"):
        options(model="dummy", min_replicas=1, max_replicas=2)  # no slots to derive the target from
    from ray.serve import deployment

    deployment(lambda: None).options(**o)  # Serve accepts it (the policy imported and pickled)


def test_the_policy_asks_for_the_replicas_that_carry_the_streams_at_the_target():
    assert desired_replicas({"a": 300, "b": 468}, target=384, current=2) == 2
    assert desired_replicas({"a": 384, "b": 384, "c": 384}, target=384, current=2) == 3
    assert desired_replicas({"a": 0}, target=384, current=1) == 0  # Serve clamps to min_replicas
    assert desired_replicas({}, target=384, current=3) == 3  # no report yet: as many as now
    ctx = SimpleNamespace(aggregated_metrics={"active": {"r1": 500, "r2": 400}}, current_num_replicas=2,
                          config=SimpleNamespace(get_target_ongoing_requests=lambda: 300.0))
    assert active_streams(ctx) == (3.0, {})
    # a replica's count: the engine's gauges in its own /metrics
    text = (b'# TYPE csmserve:num_requests_running gauge\ncsmserve:num_requests_running{model_name="m"} 12.0\n'
            b'csmserve:num_requests_waiting{model_name="m"} 3.0\ncsmserve:num_requests_other{model_name="m"} 9.0\n')
    assert engine_streams(text) == 15


def test_cpu_device_takes_no_gpu_and_flags_reach_the_replicas_and_the_ingress():
    spec, cfg = spec_from_args(parse_flags({"model": "dummy-tiny", "device": "cpu", "api_key": "k",
                                            "max_seq_len": 512, "codec_stream": False, "port": 8100,
                                            "host": "0.0.0.0", "ingress_replicas": 3, "affinity_load_factor": 1.5,
                                            "ingress_body_bytes": 65536}))
    assert spec.gpu_share == 0.0 and spec.model == "dummy-tiny" and spec.device == "cpu"
    assert spec.server.api_key == "k" and spec.server.model_name == "dummy-tiny"
    assert spec.engine.max_seq_len == 512 and spec.engine.codec_stream is False
    o = ingress_options(spec, cfg)
    assert o["num_replicas"] == 3 and o["max_replicas_per_node"] == 1 and o["ray_actor_options"] == {"num_cpus": 1.0}
    ing = IngressSpec.of(spec.server, cfg)
    assert (ing.host, ing.port, ing.model_name, ing.load_factor, ing.body_bytes) == ("0.0.0.0", 8100, "dummy-tiny",
                                                                                     1.5, 65536)
    with pytest.raises(ValueError, match="api-workers 0"):
        spec_from_args(parse_flags({"model": "dummy-tiny", "api_workers": 0}))
    with pytest.raises(ValueError, match="ingress_body_bytes"):
        spec_from_args(parse_flags({"model": "dummy-tiny", "ingress_body_bytes": 1024}))


def test_the_ingress_routes_to_ready_replicas_with_a_port():
    reports = {"b": {"ready": True, "host": "10.0.0.2", "port": 4001}, "a": {"ready": True, "host": "10.0.0.1",
               "port": 4000}, "c": {"ready": False, "host": "10.0.0.3", "port": 4002},
               "d": {"ready": True, "fatal": "engine gone", "host": "10.0.0.4", "port": 4003}, "e": {"ready": True}}
    assert [(s.name, s.host, s.port) for s in routable(reports)] == [("a", "10.0.0.1", 4000), ("b", "10.0.0.2", 4001)]


def test_the_rayservice_manifest_builds():
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config["proxy_location"] == "Disabled"  # HAProxy (the ingress) takes the serve port
    app = serve_config["applications"][0]
    assert app["import_path"] == "csmserve.ray:build_app" and app.get("route_prefix") is None
    assert build_app(app["args"]) is not None
    spec, cfg = spec_from_args(parse_flags(app["args"]))
    o = replica_options(spec, cfg)
    assert o["autoscaling_config"]["target_ongoing_requests"] == 384 and o["ray_actor_options"]["num_gpus"] == 1
    assert spec.server.host == "0.0.0.0"
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    serve_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "serve")
    assert serve_port == spec.server.port  # KubeRay's serve service and probes reach the ingress there
    pod_env = {e["name"]: e.get("value") for e in head["env"]}
    assert {k: pod_env.get(k) for k in ray_environment()} == ray_environment()  # as `serve --ray`'s own instance


def test_lora_adapters_reach_every_replica_and_the_ingress_knows_the_base_names(tmp_path):
    """--lora goes into the replicas' spec (each loads it at start, also one Ray starts later); the ingress's HAProxy
    treats as the base exactly the names the server does (anything else in `model`: an adapter's prefix key); the
    load / unload routes are answered at the ingress: 501, adapters are given at start with --ray."""
    import asyncio
    import json

    from csmserve.ray.ingress import ADAPTER_ROUTES, CSMServeIngress, frontend

    import torch

    from csmserve.models.loader import tiny_config
    from csmserve.models.lora import write_adapter

    d = write_adapter(tmp_path / "ann", tiny_config(), rank=4, dtype=torch.float32)
    spec, cfg = spec_from_args(parse_flags({"model": "dummy-tiny", "device": "cpu", "lora": [f"ann={d}"],
                                            "model_name": "mine"}))
    assert spec.adapters == (("ann", str(d)),) and spec.engine.max_loras == 1
    ing = IngressSpec.of(spec.server, cfg)
    assert ing.models == spec.server.base_models and "mine" in ing.models and "csm-1b" in ing.models
    assert frontend(ing, 9000).models == spec.server.base_models
    respond = CSMServeIngress.func_or_class.respond
    for path in ADAPTER_ROUTES:
        status, ctype, body = asyncio.run(respond(None, "POST", path))
        err = json.loads(body)["error"]
        assert status == 501 and err["code"] == "not_supported_with_ray" and "--lora" in err["message"]


def test_options_no_app_could_run_with_are_refused():
    """--affinity-load-factor under 1.01 renders a hash-balance-factor HAProxy refuses (0 or more than 100);
    --min-replicas 0 leaves an app nothing wakes (requests never pass Serve's handles)."""
    from csmserve.config import RayConfig

    with pytest.raises(ValueError, match="affinity_load_factor must be at least 1.01"):
        RayConfig(affinity_load_factor=1.0)
    with pytest.raises(ValueError, match="min_replicas"):
        RayConfig(min_replicas=0, max_replicas=4)
    assert RayConfig(affinity_load_factor=1.01, min_replicas=1, max_replicas=4).affinity_load_factor == 1.01


def test_a_stopping_replica_s_grace_follows_the_shutdown_timeout():
    """Ray kills a stopping replica past graceful_shutdown_timeout_s: room for its drain and its unit's own stop, both
    --shutdown-timeout-s long (it was a fixed 30 s, short of the default's 15 + 15 + 5)."""
    assert options(model="dummy")["graceful_shutdown_timeout_s"] >= 2 * 15 + 5
    assert options(model="dummy", shutdown_timeout_s=60)["graceful_shutdown_timeout_s"] >= 2 * 60 + 5


def test_haproxy_runs_as_many_threads_as_the_cpus_ray_reserves_for_it(monkeypatch):
    """--ingress-cpus past MAX_THREADS (4) gives HAProxy that many threads (it reserved 8 CPUs and ran 4), never more
    than the machine's cores, never fewer than 4 where the cores allow."""
    from csmserve.ray import haproxy
    from csmserve.ray.ingress import IngressSpec, frontend

    monkeypatch.setattr(haproxy.os, "cpu_count", lambda: 16)
    assert [haproxy.haproxy_threads(c) for c in (0, 1, 4, 5.5, 8, 64)] == [4, 4, 4, 6, 8, 16]
    spec, cfg = spec_from_args(parse_flags({"model": "dummy", "ingress_cpus": 8}))
    assert frontend(IngressSpec.of(spec.server, cfg), 9000).threads == 8
    monkeypatch.setattr(haproxy.os, "cpu_count", lambda: 2)
    assert haproxy.haproxy_threads(8) == 2
