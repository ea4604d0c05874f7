"""csmserve on Ray Serve, end to end on the CPU: a local Ray instance, 2 replicas of dummy-tiny behind
Serve's one port (conftest.py). The tests run in this file's order: the voice store switches to
PostgreSQL near the end, and the last tests kill replicas' engine processes, a replica's process, and
(in both replica_engine modes) a replica's engine under open streams."""
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
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from server_helpers import decode_24k, wav_bytes

REPLICA = "x-csmserve-replica"
SPEECH = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "max_audio_length_ms": 400}


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
                if s.name == name + "_total":
                    out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def settle(cluster) -> None:
    time.sleep(3 * cluster.flags["report_interval_s"])  # the directory holds every replica's latest report


def on_replica(method: str, url: str, want=lambda r: True, **kw) -> httpx.Response:
    """Send with a new x-session-id (a random place on the hash ring) until a replica `want`s it."""
    for _ in range(40):
        r = httpx.request(method, url, headers={"x-session-id": uuid.uuid4().hex}, timeout=60, **kw)
        if want(r.headers.get(REPLICA, "")):
            return r
    raise AssertionError("no request reached the wanted replica")


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
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) == 5 * 1920 * 2


def test_requests_spread_over_both_replicas_and_ready_counts_them(cluster):
    url = cluster.use()
    body = httpx.get(f"{url}/ready", timeout=10).json()
    assert body["status"] == "ready" and body["replicas"]["ready"] == body["replicas"]["total"] == 2
    served = []
    while len(served) < 20 and len({r for _, r, _ in served}) < 2:  # idle replicas take turns (router.unkeyed);
        served.append(speak(url))  # the bound leaves Ray's proxy time to learn of both on a loaded machine
    assert all(status == 200 and len(audio) == 5 * 1920 * 2 for status, _, audio in served)
    assert {r for _, r, _ in served} == replicas(url)


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
    assert r.status_code == 200 and len(r.content) == 5 * 1920 * 2
    listed = on_replica("GET", f"{url}/v1/audio/voices", lambda rep: rep != maker).json()["voices"]
    assert vid in {v["id"] for v in listed}
    deleted = on_replica("DELETE", f"{url}/v1/audio/voices/{vid}")
    assert deleted.status_code == 200
    for other in replicas(url):
        gone = on_replica("GET", f"{url}/v1/audio/voices/{vid}", lambda rep, o=other: rep == o)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "voice_not_found"
        speech = on_replica("POST", f"{url}/v1/audio/speech", lambda rep, o=other: rep == o,
                            json={**SPEECH, "voice": vid, "input": "Gone."})
        assert speech.status_code == 404


def _proc(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) of a live process, None once it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return None if rest[0] == "Z" else (comm, int(rest[1]))


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def _engines(cluster) -> dict[str, tuple[int, int]]:
    """replica -> (its pid, its engine process's pid), from the replicas' reports."""
    cluster.wait_ready(cluster.flags["num_replicas"])
    settle(cluster)
    return {r: (s["pid"], s["engine_pid"]) for r, s in cluster.reports().items()}


def _engine_files(replica_pid: int) -> list[Path]:
    """The output ring (/dev/shm/csmserve-PID-*) and socket (tmp/csmserve-PID-*/engine.sock) of a replica."""
    shm = Path("/dev/shm")
    return [*shm.glob(f"csmserve-{replica_pid}-*"), *Path(tempfile.gettempdir()).glob(f"csmserve-{replica_pid}-*/engine.sock")]


def test_each_replica_runs_its_engine_in_a_process_of_its_own(cluster):
    url = cluster.url if cluster.flags else cluster.use()  # whichever voice store is deployed
    engines = _engines(cluster)
    assert set(engines) == replicas(url)
    for replica, (pid, engine_pid) in engines.items():
        assert engine_pid is not None and engine_pid != pid
        assert _proc(engine_pid) == ("csmserve-engine", pid), replica  # the replica's child, by its name
        assert len(_engine_files(pid)) == 2, _engine_files(pid)  # its own ring and socket
    assert len({e for _, e in engines.values()}) == 2
    served = [speak(url) for _ in range(4)]
    assert all(s == 200 and len(audio) == 5 * 1920 * 2 for s, _, audio in served)


def test_killing_a_replicas_engine_process_makes_it_unhealthy_and_ray_replaces_it(cluster):
    url = cluster.url if cluster.flags else cluster.use()
    engines = _engines(cluster)
    victim, (pid, engine_pid) = sorted(engines.items())[0]
    os.kill(engine_pid, signal.SIGKILL)
    _wait(lambda: cluster.reports().get(victim, {}).get("ready") is not True, 10, "the replica reports failed")
    assert "engine" in (cluster.reports().get(victim) or {"fatal": "engine gone (forgotten)"})["fatal"]
    body = cluster.wait_ready(2, exclude={victim})  # Ray's health check failed it and started another
    assert victim not in body["replicas"]["replicas"]
    after = _engines(cluster)
    assert victim not in after and all(e != engine_pid and _proc(e) is not None for _, e in after.values())
    assert all(s == 200 for s, _, _ in (speak(url) for _ in range(4)))


def test_a_killed_replica_leaves_no_engine_process_behind(cluster):
    """The replica's actor killed (SIGKILL: no __del__): its engine process goes too (Ray kills the dead
    worker's process group, the engine's; were it left, it notices its parent gone and exits), and what it
    left in /dev/shm and tmp is gone once the replacement started (new_rundir sweeps dead pids' files)."""
    url = cluster.url if cluster.flags else cluster.use()
    engines = _engines(cluster)
    victim, (pid, engine_pid) = sorted(engines.items())[0]
    assert _proc(engine_pid) == ("csmserve-engine", pid) and len(_engine_files(pid)) == 2
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: _proc(engine_pid) is None, 10, "the engine process exits with its replica")
    cluster.wait_ready(2, exclude={victim})
    assert not _engine_files(pid)
    assert all(s == 200 for s, _, _ in (speak(url) for _ in range(4)))


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_failed_engine_ends_its_streams_with_an_error_and_its_replica_is_replaced(cluster, mode):
    """process: the replica's engine process is killed; thread: its frame step fails as a lost device does."""
    url = cluster.use(**{**(cluster.flags or {}), "replica_engine": mode})  # whichever voice store is deployed
    assert all((s["engine_pid"] is None) == (mode == "thread") for s in _engines_reports(cluster).values())
    long = {**SPEECH, "input": "A long answer. " * 20, "max_audio_length_ms": 20_000, "stream_format": "sse"}
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=long, timeout=60) as sse:
        victim = sse.headers[REPLICA]
        lines = sse.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["type"] == "speech.audio.delta"
        # a WebSocket turn on the same replica (its context_id hashes there)
        cid = next(c for c in (f"ws-{i}" for i in range(200))
                   if _home(url, c) == victim)
        ws = connect(ws_url(url, cid))
        ws.send(json.dumps({"context_id": cid, "text": "A long turn. " * 20, "flush": True,
                            "max_audio_length_ms": 20_000}))
        assert json.loads(ws.recv(timeout=60))["type"] == "audio"
        # and a plain audio stream there (a session key that hashes to it)
        key = on_replica("GET", f"{url}/v1/models", lambda rep: rep == victim).request.headers["x-session-id"]
        client = httpx.Client(timeout=60)
        pcm = client.send(client.build_request("POST", f"{url}/v1/audio/speech", headers={"x-session-id": key},
                                               json={**long, "stream_format": "audio"}), stream=True)
        assert pcm.headers[REPLICA] == victim
        pcm_chunks = pcm.iter_bytes()
        got = len(next(pcm_chunks))
        (cluster.faults / f"kill-{victim}").touch()  # the next frame step on that replica fails
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "engine" in events[-1]["error"]["message"]
    with pytest.raises(httpx.HTTPError):  # audio has no error event: the body ends short, the client says so
        for chunk in pcm_chunks:
            got += len(chunk)
    pcm.close(), client.close()
    assert got < 20_000 // 80 * 1920 * 2
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str) and json.loads(msg)["type"] == "error":
            assert "engine" in json.loads(msg)["error"]["message"]
            break
    ws.close()

    deadline = time.time() + 30  # the directory, the routers (routing stats) and Ray (health check) see it
    while time.time() < deadline and replicas(url) and "ready" == httpx.get(f"{url}/ready").json()[
            "replicas"]["replicas"].get(victim):
        time.sleep(0.1)
    time.sleep(2.0)
    served = [speak(url) for _ in range(6)]
    assert all(s == 200 for s, _, _ in served), served
    assert victim not in {r for _, r, _ in served}
    body = cluster.wait_ready(2, exclude={victim})  # Ray replaced it
    assert victim not in body["replicas"]["replicas"]


def _engines_reports(cluster) -> dict[str, dict]:
    settle(cluster)
    return cluster.reports()


def _home(url: str, context_id: str) -> str:
    with connect(ws_url(url, context_id)) as ws:
        return ws.response.headers[REPLICA]
