"""A local Ray instance (no dashboard, no usage reporting, no network) and csmserve's Ray Serve
application on it: `cluster.use(**flags)` deploys `dummy-tiny` replicas with those `csmserve serve`
flags (again only when they change; each replica with its own engine process unless
replica_engine="thread") -> the base URL of Serve's one port."""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "server"))  # server_helpers: wav_bytes, decode_24k, free_port

BASE_FLAGS = {"model": "dummy-tiny", "device": "cpu", "dtype": "float32", "num_replicas": 2,
              "cpus_per_replica": 0.5, "max_slots": 8, "max_seq_len": 512, "first_chunk_frames": 1,
              "chunk_frames": 2, "default_audio_length_ms": 400, "health_check_period_s": 1.0,
              "report_interval_s": 0.25, "log_level": "warning", "replica_engine": "process"}


def _require_ray():
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no ray[serve] (pip install 'csmserve[ray]')")


class Cluster:
    def __init__(self, url: str, faults: Path) -> None:
        self.url, self.faults, self.flags = url, faults, None

    def use(self, **flags) -> str:
        from ray import serve

        from csmserve.ray.app import application, parse_flags, spec_from_args

        flags = {**BASE_FLAGS, "voices_db": str(self.faults / "voices.db"), **flags}
        if flags != self.flags:
            spec, cfg = spec_from_args(parse_flags(flags))
            spec = dataclasses.replace(spec, csm_factory="ray_faults:faulty_csm")
            serve.run(application(spec, cfg), name="csmserve", route_prefix="/")
            self.flags = flags
            self.wait_ready(flags["num_replicas"])
        return self.url

    def reports(self) -> dict[str, dict]:
        """Every replica's last report to the directory (its state, pid, engine_pid)."""
        from ray import serve

        return serve.get_deployment_handle("CSMServeDirectory", "csmserve").snapshot.remote().result()

    def wait_ready(self, n: int, timeout: float = 120.0, exclude: set[str] = frozenset()) -> dict:
        """Until /ready counts n ready replicas (none of `exclude`) -> its body."""
        import httpx

        deadline = time.time() + timeout
        while True:
            try:
                body = httpx.get(f"{self.url}/ready", timeout=10).json()
                states = body.get("replicas", {}).get("replicas", {})
                ready = [r for r, s in states.items() if s == "ready" and r not in exclude]
                if len(ready) == n and len(states) == n:
                    return body
            except (httpx.HTTPError, ValueError):
                pass
            if time.time() > deadline:
                raise TimeoutError(f"{n} replicas not ready in {timeout} s")
            time.sleep(0.25)


@pytest.fixture(scope="session")
def cluster():
    _require_ray()
    from server_helpers import free_port

    from csmserve.config import RayConfig
    from csmserve.ray.app import ensure_importable, ray_environment

    faults = Path(tempfile.mkdtemp(prefix="csmserve-faults-"))
    # the environment `csmserve serve --ray` gives its Ray instance (CSMSERVE_PROXY_TRANSPORT=actor: Ray's own path)
    transport = os.environ.get("CSMSERVE_PROXY_TRANSPORT") or RayConfig().proxy_transport
    os.environ.update({**ray_environment(RayConfig(proxy_transport=transport)), "CSMSERVE_TEST_FAULTS": str(faults),
                       "RAY_DEDUP_LOGS": "0"})
    ensure_importable()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ["PYTHONPATH"]])  # ray_faults
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield Cluster(f"http://127.0.0.1:{port}", faults)
    finally:
        serve.shutdown()
        ray.shutdown()
