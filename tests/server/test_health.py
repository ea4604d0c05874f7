"""Models, health, readiness, metrics."""
import logging
import threading
import time

import httpx
import pytest

from server_helpers import error_of


def test_models(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    ids = [m["id"] for m in models["data"]]
    assert {"tts-1", "sesame/csm-1b"} <= set(ids)
    assert all(set(m) == {"id", "object", "created", "owned_by"} for m in models["data"])
    assert httpx.get(f"{server.url}/v1/audio/models").json()["models"][0] == {"id": "sesame/csm-1b"}
    assert httpx.get(f"{server.url}/v1/models/tts-1").json()["id"] == "tts-1"
    assert error_of(httpx.get(f"{server.url}/v1/models/nope"))["code"] == "model_not_found"


def test_health_and_ready(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_ready_is_503_until_loaded(serve, csm):
    gate = threading.Event()

    def load():
        gate.wait(30)
        return csm

    from csmserve.config import ServerConfig
    from csmserve.server import create_app
    from server_helpers import Server

    server = Server(create_app(None, ServerConfig(voices_db=":memory:"), load=load)).start()
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        r = httpx.get(f"{server.url}/ready")
        assert r.status_code == 503 and error_of(r)["code"] == "model_not_ready"
        r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "hi"})
        assert r.status_code == 503 and error_of(r)["code"] == "model_not_ready"
        gate.set()
        for _ in range(200):
            if httpx.get(f"{server.url}/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert httpx.get(f"{server.url}/ready").status_code == 200
    finally:
        server.app.state.server.csm = None  # not ours to close
        server.stop()


def test_metrics_names(server):
    r = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={
        "model": "tts-1", "voice": "alloy", "input": "metrics", "response_format": "pcm", "max_audio_length_ms": 160})
    assert r.status_code == 200
    httpx.post(f"{server.url}/v1/audio/speech", json={"model": "tts-1", "voice": "nobody", "input": "x"})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("csmserve:time_to_first_audio_seconds_bucket", "csmserve:real_time_factor_bucket",
                 "csmserve:num_requests_running", "csmserve:num_requests_waiting",
                 "csmserve:request_queue_time_seconds_bucket", "csmserve:generated_frames_total",
                 "csmserve:generated_audio_seconds_total", "csmserve:e2e_request_latency_seconds_bucket",
                 'csmserve:request_errors_total{model_name="sesame/csm-1b",status="404"}'):
        assert name in text, name
    frames = [line for line in text.splitlines() if line.startswith("csmserve:generated_frames_total")]
    assert float(frames[0].split()[-1]) >= 1


@pytest.mark.inproc
def test_metrics_count_prefix_cache_hits(server, csm):
    """The engine's PrefixCache counters are Prometheus counters: a conversation's second request with
    the same earlier turn hits the prefix its first one stored."""
    def value(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(next(line for line in text.splitlines() if line.startswith(name + "{")).split()[-1])

    hits, stores = value("csmserve:prefix_cache_hits_total"), value("csmserve:prefix_cache_stores_total")
    body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "max_audio_length_ms": 160,
            "context": [{"speaker": 1, "text": "An earlier turn that only this test says, for the cache."}]}
    for text in ("First.", "Second."):
        assert httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={**body, "input": text}).status_code == 200
    assert value("csmserve:prefix_cache_stores_total") >= stores + 1
    assert value("csmserve:prefix_cache_hits_total") >= hits + 1
    assert "csmserve:prefix_cache_misses_total" in httpx.get(f"{server.url}/metrics").text


@pytest.mark.inproc
def test_a_lost_device_turns_ready_and_health_503_and_refuses_in_the_error_shape(server, csm, monkeypatch):
    """After the engine lost its device (Engine.fatal; the engine side is tests/engine/test_engine.py),
    an orchestrator sees 503 on /health and /ready (and restarts the process); requests get a 503 in
    OpenAI's error shape, not a hang. The shared engine's thread is left alone: its `fatal` is read
    through a stand-in."""
    assert server.state.engine_fatal() is None and csm.engine.fatal is None
    monkeypatch.setattr(server.state, "engine_fatal", lambda: "RuntimeError: CUDA error: device-side assert triggered")
    for path in ("/health", "/ready"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 503 and error_of(r)["code"] == "engine_failed"
        assert "device-side assert" in error_of(r)["message"]
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "hi"})
    assert r.status_code == 503 and error_of(r)["code"] == "engine_failed"
    monkeypatch.undo()
    assert httpx.get(f"{server.url}/ready").status_code == 200


@pytest.mark.inproc
def test_an_engine_silent_past_the_stall_limit_turns_ready_and_health_503_until_it_sends(server, csm, monkeypatch,
                                                                                       caplog):
    """An API worker's side of a hung engine process (test_processes.py stops a real one): its client's last word
    older than --engine-stall-s (30 s) is 503 engine_stalled on /health and /ready, a newer one 200 again; each
    turn logged once. The shared engine is left alone: only its client's `last_word` is set."""
    client = server.state.csm.client
    monkeypatch.setattr(client, "last_word", time.monotonic() - 31, raising=False)  # (the stand-in has none)
    with caplog.at_level(logging.INFO, "csmserve.server"):
        for path in ("/health", "/ready", "/health"):
            r = httpx.get(f"{server.url}{path}")
            assert r.status_code == 503 and error_of(r)["code"] == "engine_stalled", r.text
            assert "sent nothing for 3" in error_of(r)["message"]
        client.last_word = time.monotonic()
        for path in ("/health", "/ready", "/health"):
            assert httpx.get(f"{server.url}{path}").status_code == 200
    said = [r.getMessage() for r in caplog.records]
    assert [sum(what in m for m in said) for what in ("has sent nothing for", "sends again after")] == [1, 1], said
