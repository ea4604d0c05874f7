"""csmserve on Ray Serve, end to end on the CPU: a Ray instance of the tests' own, `dummy-tiny` replicas (each
a whole `csmserve serve` unit: engine-core process + API worker) behind the HAProxy ingress (conftest.py).
The tests run in this file's order: 2 replicas on SQLite voices, then PostgreSQL, then 4 replicas, whose
engine processes and replica processes the last tests kill under open streams."""
from __future__ import annotations

import base64
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from server_helpers import decode_24k, wav_bytes

REPLICA = "x-csmserve-replica"
SPEECH = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "max_audio_length_ms": 400}
PCM_400MS = 5 * 1920 * 2


def speak(url: str, headers: dict | None = None, **body) -> tuple[int, str, bytes]:
    """POST /v1/audio/speech, streamed -> (status, the replica that served it, the body)."""
    with httpx.stream("POST", f"{url}/v1/audio/speech", json={**SPEECH, "input": "Hello there.", **body},
                      headers=headers or {}, timeout=60) as r:
        return r.status_code, r.headers.get(REPLICA, ""), r.read()


def replicas(url: str) -> set[str]:
    return set(httpx.get(f"{url}/ready", timeout=10).json()["replicas"]["replicas"])


def counter(url: str, name: str) -> dict[str, float]:
    """A csmserve counter from the application's /metrics -> {replica: value}."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if fam.name == name:
            for s in fam.samples:
                if s.name in (name, name + "_total"):
                    out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def settle(cluster) -> None:
    time.sleep(3 * cluster.flags["report_interval_s"])  # the directory holds every replica's latest report


def session_key(url: str, want) -> str:
    """An x-session-id that the ingress routes to a replica `want`s (its place on the hash ring)."""
    for _ in range(60):
        key = uuid.uuid4().hex
        if want(httpx.get(f"{url}/v1/models", headers={"x-session-id": key}, timeout=30).headers[REPLICA]):
            return key
    raise AssertionError("no key reached the wanted replica")


def on_replica(method: str, url: str, want=lambda r: True, **kw) -> httpx.Response:
    r = httpx.request(method, url, headers={"x-session-id": session_key(url.split("/v1")[0], want)}, timeout=60, **kw)
    assert want(r.headers[REPLICA])
    return r


def ws_url(url: str, context_id: str) -> str:
    return url.replace("http://", "ws://") + f"/v1/audio/speech/stream?context_id={context_id}"


def ws_turn(ws, context_id: str, text: str, **extra) -> dict:
    ws.send(json.dumps({"context_id": context_id, "text": text, "flush": True, "voice": "alloy",
                        "max_audio_length_ms": 400, **extra}))
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str):
            m = json.loads(msg)
            if m["type"] in ("flush_done", "error"):
                return m


def create_voice(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/voices", timeout=60, data={"name": name, "transcript": "A clip."},
                      files={"audio_sample": ("ref.wav", wav_bytes(1.0), "audio/wav")})


def test_openai_client_streams_pcm_and_mp3_and_sse(cluster):
    url = cluster.use()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for fmt in ("pcm", "mp3"):
        with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="alloy", input="Streaming through Ray Serve.", response_format=fmt,
                extra_body={"max_audio_length_ms": 400}) as r:
            assert r.status_code == 200 and r.headers[REPLICA]
            chunks = list(r.iter_bytes())
        audio = decode_24k(b"".join(chunks), fmt)
        assert len(audio) >= 1920 * 4, fmt  # 5 frames of 80 ms (mp3 may pad)
    with httpx.stream("POST", f"{url}/v1/audio/speech", timeout=60,
                      json={**SPEECH, "input": "Events.", "stream_format": "sse"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and events[-1]["type"] == "speech.audio.done"
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) == PCM_400MS


def test_requests_without_a_key_spread_over_both_and_ready_and_health_answer(cluster):
    url = cluster.use()
    body = httpx.get(f"{url}/ready", timeout=10).json()
    assert body["status"] == "ready" and body["replicas"]["ready"] == body["replicas"]["total"] == 2
    served = [speak(url) for _ in range(6)]  # one at a time: least connections, idle replicas in turn
    assert all(status == 200 and len(audio) == PCM_400MS for status, _, audio in served)
    assert {r for _, r, _ in served} == replicas(url)
    health = [httpx.get(f"{url}/health", timeout=10) for _ in range(4)]  # the answering replica's own
    assert all(h.status_code == 200 for h in health) and {h.headers[REPLICA] for h in health} == replicas(url)
    assert httpx.get(f"{url}/-/healthz", timeout=10).text == "success"  # what KubeRay's probes ask


def test_each_replica_is_a_whole_unit_and_its_actor_carries_no_stream(cluster):
    """A replica = an engine-core process + its API workers, children of the replica's actor, on a port of
    its own; during a stream the actor holds no connection on that port (the worker has it)."""
    url = cluster.use()
    settle(cluster)
    reports = cluster.reports()
    assert set(reports) == replicas(url) and len({s["port"] for s in reports.values()}) == 2
    for name, s in reports.items():
        actor = psutil.Process(s["pid"])
        engine, (worker,) = psutil.Process(s["engine_pid"]), [psutil.Process(p) for p in s["worker_pids"]]
        assert engine.ppid() == worker.ppid() == s["pid"] and engine.name() == "csmserve-engine", name
        assert worker.name() == "csmserve-api-0"
        key = session_key(url, lambda r, n=name: r == n)
        with httpx.stream("POST", f"{url}/v1/audio/speech", headers={"x-session-id": key}, timeout=60,
                          json={**SPEECH, "input": "A longer answer. " * 4, "max_audio_length_ms": 4000}) as r:
            assert r.headers[REPLICA] == name and r.headers["x-csmserve-worker"] == "0"
            chunks = r.iter_bytes()
            next(chunks)

            def streams(p: psutil.Process) -> list:
                return [c for c in p.net_connections("tcp") if c.laddr.port == s["port"] and c.status == "ESTABLISHED"]

            assert streams(worker) and not streams(actor)
            for _ in chunks:
                pass


def test_metrics_of_every_replica_labelled_by_replica(cluster):
    url = cluster.use()
    settle(cluster)
    before = counter(url, "csmserve:generated_frames")
    for _ in range(6):
        speak(url)
    settle(cluster)
    after = counter(url, "csmserve:generated_frames")
    assert set(after) == replicas(url)
    assert sum(after.values()) - sum(before.values()) == 6 * 5


def test_websocket_conversation_stays_on_its_replica_and_reuses_its_prefix_cache(cluster):
    url = cluster.use()
    settle(cluster)
    hits0, done0 = counter(url, "csmserve:prefix_cache_hits"), counter(url, "csmserve:request_success")
    cid = f"talk-{uuid.uuid4().hex[:8]}"
    with connect(ws_url(url, cid)) as ws:
        home = ws.response.headers[REPLICA]
        for text in ("The first turn of our talk.", "A second turn.", "And a third one."):
            assert ws_turn(ws, cid, text)["type"] == "flush_done"
    with connect(ws_url(url, cid)) as ws:  # the conversation comes back: same replica, its session there
        assert ws.response.headers[REPLICA] == home
        assert ws_turn(ws, cid, "A fourth, after reconnecting.")["type"] == "flush_done"
    settle(cluster)
    hits, done = counter(url, "csmserve:prefix_cache_hits"), counter(url, "csmserve:request_success")
    grew = {r: done.get(r, 0) - done0.get(r, 0) for r in done}
    assert grew[home] == 4 and sum(grew.values()) == 4  # every turn on one replica
    # turns 3 and 4 reuse the earlier turns' prefix (turn 2's prompt stored it; turn 4 only if the
    # session, kept on that replica, gave it its history)
    assert hits.get(home, 0) - hits0.get(home, 0) >= 2


def test_a_stored_voice_prefers_its_replica_and_a_hot_one_spills(cluster):
    url = cluster.use()
    voice = create_voice(url, "narrator").json()["id"]
    settle(cluster)
    hits0 = counter(url, "csmserve:prefix_cache_hits")
    served = [speak(url, voice=voice, input=f"Line {i}.") for i in range(4)]
    assert all(s == 200 for s, _, _ in served)
    homes = {r for _, r, _ in served}
    assert len(homes) == 1  # one at a time: always the voice's replica
    settle(cluster)
    home = homes.pop()
    assert counter(url, "csmserve:prefix_cache_hits")[home] - hits0.get(home, 0) >= 3  # the clip prefilled once

    results: list[tuple[int, str, bytes]] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        speak(url, voice=voice, input=f"Burst {i}.", max_audio_length_ms=1600))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 for s, _, _ in results)
    assert {r for _, r, _ in results} == replicas(url)  # 8 at once: past the load bound, the other takes some


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_voice_created_on_one_replica_is_used_on_the_other_and_deleted_everywhere(cluster, backend, request):
    url = cluster.use(voices_db=request.getfixturevalue("pg_url")) if backend == "postgres" else cluster.use()
    created = create_voice(url, f"shared-{backend}")
    assert created.status_code == 200, created.text
    maker, vid = created.headers[REPLICA], created.json()["id"]
    r = on_replica("POST", f"{url}/v1/audio/speech", lambda rep: rep != maker,
                   json={**SPEECH, "voice": vid, "input": "Spoken by the other replica."})
    assert r.status_code == 200 and len(r.content) == PCM_400MS
    listed = on_replica("GET", f"{url}/v1/audio/voices", lambda rep: rep != maker).json()["voices"]
    assert vid in {v["id"] for v in listed}
    assert on_replica("DELETE", f"{url}/v1/audio/voices/{vid}").status_code == 200
    for other in replicas(url):
        gone = on_replica("GET", f"{url}/v1/audio/voices/{vid}", lambda rep, o=other: rep == o)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "voice_not_found"
        speech = on_replica("POST", f"{url}/v1/audio/speech", lambda rep, o=other: rep == o,
                            json={**SPEECH, "voice": vid, "input": "Gone."})
        assert speech.status_code == 404


def test_four_replicas_on_one_machine(cluster):
    """Serve scales the deployment to 4 (the voice store stays whatever the last test deployed); the ingress
    routes to all of them: least connections without a key, conversations over the whole ring."""
    url = cluster.use(**{**cluster.current(), "num_replicas": 4})
    names = replicas(url)
    assert len(names) == 4
    settle(cluster)
    reports = cluster.reports()
    assert len({s["port"] for s in reports.values()}) == len({s["engine_pid"] for s in reports.values()}) == 4
    assert {r for _, r, _ in (speak(url) for _ in range(8))} == names
    homes = set()
    for i in range(24):
        with connect(ws_url(url, f"four-{i}")) as ws:
            homes.add(ws.response.headers[REPLICA])
    assert homes == names


def _proc(pid: int) -> psutil.Process | None:
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p
    except psutil.NoSuchProcess:
        return None


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def _open_streams(url: str, victim: str) -> dict:
    """An SSE stream, a plain pcm stream and a WebSocket turn, each on `victim`, each past its first audio."""
    long = {**SPEECH, "input": "A long answer. " * 20, "max_audio_length_ms": 20_000}
    key = session_key(url, lambda r: r == victim)
    client = httpx.Client(timeout=60)
    sse = client.send(client.build_request("POST", f"{url}/v1/audio/speech", headers={"x-session-id": key},
                                           json={**long, "stream_format": "sse"}), stream=True)
    lines = sse.iter_lines()
    assert sse.headers[REPLICA] == victim
    assert json.loads(next(x for x in lines if x)[6:])["type"] == "speech.audio.delta"
    pcm = client.send(client.build_request("POST", f"{url}/v1/audio/speech", headers={"x-session-id": key},
                                           json=long), stream=True)
    chunks = pcm.iter_bytes()
    assert pcm.headers[REPLICA] == victim and len(next(chunks)) > 0
    cid = next(c for c in (f"ws-{uuid.uuid4().hex[:6]}" for _ in range(200))
               if httpx.get(f"{url}/v1/models", params={"context_id": c}).headers[REPLICA] == victim)
    ws = connect(ws_url(url, cid))
    assert ws.response.headers[REPLICA] == victim
    ws.send(json.dumps({"context_id": cid, "text": "A long turn. " * 20, "flush": True, "max_audio_length_ms": 20_000}))
    assert json.loads(ws.recv(timeout=60))["type"] == "audio"
    return {"client": client, "sse": (sse, lines), "pcm": (pcm, chunks), "ws": ws}


def _each_ends_with_an_error(streams: dict) -> None:
    sse, lines = streams["sse"]
    events = []
    try:
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    except httpx.HTTPError:  # the replica's process gone: the connection itself ends short
        pass
    assert not events or events[-1]["type"] == "error", events[-1:]
    pcm, chunks = streams["pcm"]
    got = 0
    with pytest.raises(httpx.HTTPError):  # audio has no error event: the body ends short, the client says so
        for chunk in chunks:
            got += len(chunk)
    assert got < 20_000 // 80 * 1920 * 2
    ws = streams["ws"]
    try:
        while True:
            msg = ws.recv(timeout=60)
            if isinstance(msg, str) and json.loads(msg)["type"] == "error":
                break
    except Exception:  # noqa: BLE001 - the connection closed under it: an error too
        pass
    ws.close()
    sse.close(), pcm.close(), streams["client"].close()


def _next_requests_succeed_elsewhere(url: str, victim: str) -> None:
    served = [speak(url) for _ in range(6)]
    assert all(s == 200 and len(audio) == PCM_400MS for s, _, audio in served), served
    assert victim not in {r for _, r, _ in served}


def test_a_killed_engine_ends_its_replicas_streams_with_an_error_and_ray_replaces_it(cluster):
    url = cluster.use(**cluster.current())
    n = cluster.flags["num_replicas"]
    settle(cluster)
    victim, report = sorted(cluster.reports().items())[0]
    streams = _open_streams(url, victim)
    os.kill(report["engine_pid"], signal.SIGKILL)
    _each_ends_with_an_error(streams)
    _next_requests_succeed_elsewhere(url, victim)
    body = cluster.wait_ready(n, exclude={victim})  # Ray's health check failed it and started another
    assert victim not in body["replicas"]["replicas"]


def test_a_killed_replica_leaves_no_process_or_file_behind_and_is_replaced(cluster):
    """The replica's actor killed (SIGKILL: no __del__): its engine and API workers exit with it (each watches
    its parent), its streams end with an error, the next requests go elsewhere, and what it left in /dev/shm
    and tmp is gone once its replacement started (new_rundir sweeps dead pids' files)."""
    url = cluster.use(**cluster.current())
    n = cluster.flags["num_replicas"]
    settle(cluster)
    victim, report = sorted(cluster.reports().items())[0]
    children = [report["engine_pid"], *report["worker_pids"]]
    files = [*Path("/dev/shm").glob(f"csmserve-{report['pid']}-*"),
             *Path(tempfile.gettempdir()).glob(f"csmserve-{report['pid']}-*")]
    assert files
    streams = _open_streams(url, victim)
    os.kill(report["pid"], signal.SIGKILL)
    _each_ends_with_an_error(streams)
    _next_requests_succeed_elsewhere(url, victim)
    _wait(lambda: not any(_proc(p) for p in children), 10, "the engine and workers exit with their replica")
    cluster.wait_ready(n, exclude={victim})
    assert not any(f.exists() for f in files)


def _haproxy(port: int) -> list[psutil.Process]:
    """The HAProxy processes (master and workers) listening on `port`, by their config."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.info["name"] == "haproxy" and "-f" in cmd:
            try:
                if f":{port}\n" in Path(cmd[cmd.index("-f") + 1]).read_text():
                    out.append(p)
            except OSError:
                pass
    return out


def test_a_killed_ingress_takes_its_haproxy_with_it_and_is_replaced(cluster):
    url = cluster.use(**cluster.current())
    procs = _haproxy(cluster.port)
    (actor,) = {psutil.Process(p.ppid()) for p in procs if psutil.Process(p.ppid()).name() != "haproxy"}
    assert "CSMServeIngress" in " ".join(actor.cmdline())
    os.kill(actor.pid, signal.SIGKILL)
    _wait(lambda: not any(_proc(p.pid) for p in procs), 10, "HAProxy exits with its ingress (parent-death signal)")
    cluster.wait_ready(cluster.flags["num_replicas"])  # Serve started another: HAProxy on the same port again
    assert all(s == 200 for s, _, _ in (speak(url) for _ in range(2)))


def test_serve_autoscales_on_the_streams_the_replicas_report(cluster):
    """Requests never pass Serve's handles: the replicas' own count (open generations, here WebSocket turns
    holding their slot while their text is still coming) drives Serve's autoscaler through the policy.
    Serve's delays made short for the test; the rest is `application`'s."""
    from ray import serve

    from csmserve.ray.app import ingress_options, parse_flags, replica_options, spec_from_args
    from csmserve.ray.directory import Directory
    from csmserve.ray.ingress import CSMServeIngress, IngressSpec
    from csmserve.ray.replica import CSMServeReplica

    flags = {k: v for k, v in cluster.current().items() if k != "num_replicas"}
    spec, cfg = spec_from_args(parse_flags({**flags, "min_replicas": 1, "max_replicas": 2,
                                            "target_ongoing_requests": 1}))
    opts = replica_options(spec, cfg)
    opts["autoscaling_config"].update(metrics_interval_s=0.25, look_back_period_s=1.0, upscale_delay_s=0.0,
                                      downscale_delay_s=0.0)
    directory = Directory.bind(cfg.report_interval_s)
    replicas_ = CSMServeReplica.options(**opts).bind(spec, directory, cfg.report_interval_s, cfg.cpus_per_replica)
    serve.run(CSMServeIngress.options(**ingress_options(spec, cfg)).bind(IngressSpec.of(spec.server, cfg), directory,
                                                                         replicas_), name="csmserve", route_prefix=None)
    cluster.flags = None  # the next cluster.use() deploys again
    url = cluster.url
    cluster.wait_ready(1, timeout=120)  # nothing open: down to min_replicas
    sockets = []
    try:
        for i in range(3):  # 3 open turns at a target of 1 each: up to max_replicas
            ws = connect(ws_url(url, f"scale-{i}"))
            ws.send(json.dumps({"context_id": f"scale-{i}", "text": "A first sentence. And the", "voice": "alloy",
                                "max_audio_length_ms": 60_000}))  # no flush: the turn holds its slot, idle
            sockets.append(ws)
        cluster.wait_ready(2, timeout=120)
    finally:
        for ws in sockets:
            ws.close()


def test_lora_adapters_given_at_start_are_served_by_every_replica(cluster, tmp_path):
    """`--ray --lora ann=DIR`: every replica loads it at start (/v1/models on each lists it); a request's model
    picks it and stays on one replica (the ingress's `lora:<model>` key); a model that is neither the base nor an
    adapter is a 404; the load / unload routes are answered at the ingress: 501 (adapters are given at start)."""
    import torch

    from csmserve.models.loader import tiny_config
    from csmserve.models.lora import write_adapter

    write_adapter(tmp_path / "ann", tiny_config(), rank=4, seed=1, std=0.3, dtype=torch.float32)
    url = cluster.use(lora=f"ann={tmp_path / 'ann'}")
    for name in replicas(url):
        r = on_replica("GET", f"{url}/v1/models", lambda rep, n=name: rep == n)
        assert {m["id"]: m.get("parent") for m in r.json()["data"]}["ann"] == "dummy-tiny"
    served = [speak(url, model="ann", temperature=0) for _ in range(4)]
    assert {s for s, _, _ in served} == {200} and len({r for _, r, _ in served}) == 1
    assert all(len(body) == PCM_400MS for _, _, body in served) and len({b for _, _, b in served}) == 1
    status, _, body = speak(url, model="nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(f"{url}{path}", json={"lora_name": "cat", "lora_path": "cat"}, timeout=30)
        assert r.status_code == 501 and r.json()["error"]["code"] == "not_supported_with_ray"
