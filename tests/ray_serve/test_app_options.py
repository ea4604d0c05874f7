"""From `csmserve serve` flags (or Serve's builder args, or the RayService manifest) to the deployment's
Ray options: replicas or autoscaling, GPU shares, Ray's per-replica cap, health checks, the router."""
import os
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
import yaml  # noqa: E402

from csmserve.ray.app import build_app, deployment_options, parse_flags, spec_from_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def options(**flags) -> dict:
    return deployment_options(*spec_from_args(parse_flags(flags)))


def test_fixed_replicas_with_fractional_gpus():
    o = options(model="dummy", num_replicas=2, gpus_per_replica=0.5, max_slots=256)
    assert o["num_replicas"] == 2 and "autoscaling_config" not in o
    assert o["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert o["max_ongoing_requests"] == 256 + 1024  # slots + --max-waiting: Ray never caps below the engine
    assert o["health_check_period_s"] == 2.0
    router = o["request_router_config"]
    assert router.request_router_class.endswith("AffinityRouter")
    assert router.request_router_kwargs == {"load_factor": 1.25}


def test_autoscaling_target_from_the_slots():
    o = options(model="dummy", min_replicas=1, max_replicas=8, max_slots=512)
    assert "num_replicas" not in o
    assert o["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 384}
    o = options(model="dummy", max_replicas=3, target_ongoing_requests=100)
    assert o["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 100}
    with pytest.raises(ValueError, match="max-slots"):
        options(model="dummy", min_replicas=1, max_replicas=2)  # no slots to derive the target from


def test_cpu_device_takes_no_gpu_and_flags_reach_the_replicas():
    spec, cfg = spec_from_args(parse_flags({"model": "dummy-tiny", "device": "cpu", "api_key": "k",
                                            "max_seq_len": 512, "codec_stream": False}))
    assert spec.gpu_share == 0.0 and spec.model == "dummy-tiny" and spec.device == "cpu"
    assert spec.server.api_key == "k" and spec.server.model_name == "dummy-tiny"
    assert spec.engine.max_seq_len == 512 and spec.engine.codec_stream is False


def test_the_rayservice_manifest_builds():
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    app = serve_config["applications"][0]
    assert app["import_path"] == "csmserve.ray:build_app"
    assert build_app(app["args"]) is not None
    o = options(**app["args"])
    assert o["autoscaling_config"]["target_ongoing_requests"] == 384 and o["ray_actor_options"]["num_gpus"] == 1
    from csmserve.config import RayConfig
    from csmserve.ray.app import ray_environment

    pod_env = {e["name"]: e.get("value") for e in
               manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    serve_env = {k: v for k, v in ray_environment(RayConfig()).items()
                 if k.startswith("RAY_SERVE_")}  # what `serve --ray` gives its own instance: the pods too
    assert {k: pod_env.get(k) for k in serve_env} == serve_env


def test_replicas_run_their_engine_in_a_process_by_default_and_a_flag_keeps_the_thread(monkeypatch):
    spec, cfg = spec_from_args(parse_flags({"model": "dummy-tiny", "device": "cpu", "codec_dtype": "float32"}))
    assert cfg.replica_engine == spec.replica_engine == "process" and spec.codec_dtype == "float32"
    spec, cfg = spec_from_args(parse_flags({"model": "dummy-tiny", "replica_engine": "thread"}))
    assert cfg.replica_engine == spec.replica_engine == "thread"
    monkeypatch.setenv("CSMSERVE_REPLICA_ENGINE", "thread")
    assert spec_from_args(parse_flags({"model": "dummy-tiny"}))[0].replica_engine == "thread"
    with pytest.raises(ValueError, match="replica_engine"):
        spec_from_args(parse_flags({"model": "dummy-tiny", "replica_engine": "fork"}))


def test_the_proxy_reaches_replicas_over_grpc_by_default_and_a_flag_keeps_rays_actor_calls(monkeypatch):
    from csmserve.ray.app import PROXY_CALLBACK, PROXY_CALLBACK_ENV, ray_environment, set_ray_environment

    monkeypatch.delenv("CSMSERVE_PROXY_TRANSPORT", raising=False)
    cfg = spec_from_args(parse_flags({"model": "dummy-tiny"}))[1]
    env = ray_environment(cfg)
    assert cfg.proxy_transport == "grpc"
    assert env["RAY_SERVE_PROXY_USE_GRPC"] == "1" and env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert int(env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > 4 << 20  # a batch of queued audio fits
    assert env[PROXY_CALLBACK_ENV] == PROXY_CALLBACK and env["RAY_worker_niceness"] == "0"
    actor = ray_environment(spec_from_args(parse_flags({"model": "dummy-tiny", "proxy_transport": "actor"}))[1])
    assert actor["RAY_SERVE_PROXY_USE_GRPC"] == "0" and actor["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "1"
    with pytest.raises(ValueError, match="proxy_transport"):
        spec_from_args(parse_flags({"model": "dummy-tiny", "proxy_transport": "http"}))

    for key in env:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")  # the user's own variable wins
    set_ray_environment(cfg)
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "0" and os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
