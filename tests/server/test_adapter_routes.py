"""LoRA adapters through the server (CPU, dummy-tiny, float32): OpenAI's `model` picks an adapter (the openai client,
unmodified), the base's names keep the base, the load / unload routes while another stream runs (its audio whole and
unchanged), every bad input refused in the API's shape while other streams go on, voices bound to an adapter, the
WebSocket's `model`, /v1/models, the per-adapter metrics, a full pool (503 past --max-lora-wait-s), and `csmserve
serve --lora` as processes (the API worker's CSM.attach)."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from websockets.sync.client import connect

from server_helpers import SHORT_MS, ProcServer, Server, error_of, wav_bytes

from csmserve import CSM, Segment
from csmserve.config import EngineConfig, ServerConfig
from csmserve.models.loader import tiny_config
from csmserve.models.lora import write_adapter
from csmserve.server import create_app

FRAMES = 6  # each request's frames (greedy or seeded: the adapter's codes, compared)
LONG = 48  # a stream that runs while adapters are loaded, unloaded, refused
TEXT = "Hello there."
BASE_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "csm-1b", "sesame/csm-1b")


def adapter_dir(root, name: str, seed: int, cfg=None, rank: int = 4, **config):
    d = write_adapter(root / name, cfg or tiny_config(), rank=rank, seed=seed, std=0.3, dtype=torch.float32)
    if config:
        path = d / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """--lora-dir: ann, bob (served from the start), cat and dan (loaded at run time)."""
    r = tmp_path_factory.mktemp("loras")
    for i, name in enumerate(("ann", "bob", "cat", "dan")):
        adapter_dir(r, name, seed=i)
    return r


def make_csm(root, **engine) -> CSM:
    cfg = EngineConfig(max_slots=8, max_seq_len=512, first_chunk_frames=1, chunk_frames=2, max_loras=2,
                       max_lora_rank=8, max_cpu_loras=3, **engine)
    c = CSM("dummy-tiny", device="cpu", dtype="float32", engine_config=cfg,
            adapters={"ann": str(root / "ann"), "bob": str(root / "bob")})
    _ = c.client
    return c


@pytest.fixture(scope="module")
def lcsm(root):
    c = make_csm(root)
    yield c
    c.close()


@pytest.fixture(scope="module")
def lserver(lcsm, root, tmp_path_factory):
    db = tmp_path_factory.mktemp("voices") / "voices.db"
    s = Server(create_app(lcsm, ServerConfig(voices_db=str(db), default_audio_length_ms=SHORT_MS, lora_dir=str(root),
                                             model_name="sesame/csm-1b"))).start()
    s.codes = record(s.state)
    yield s
    s.stop()


def record(state) -> dict:
    """request id -> the codes the server streamed for it (the route's own stream, wrapped)."""
    codes: dict[str, list] = {}
    stream = state.stream

    async def recorded(request, arrival, on_submit=None):
        async for chunk in stream(request, arrival, on_submit):
            codes.setdefault(request.request_id, []).append(chunk.codes)
            yield chunk

    state.stream = recorded
    return codes


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def speech_codes(server, model: str, frames: int = FRAMES, text: str = TEXT, **extra) -> np.ndarray:
    """The codes of one speech request through the openai client (pcm; greedy unless extra says)."""
    r = client(server).audio.speech.with_raw_response.create(
        model=model, voice=extra.pop("voice", "alloy"), input=text, response_format="pcm",
        extra_body={"temperature": 0, "max_audio_length_ms": frames * 80, **extra})
    pcm = r.content
    codes = np.concatenate(server.codes.pop(r.headers["x-request-id"]))
    assert len(pcm) == len(codes) * 1920 * 2  # every frame's audio arrived
    return codes


_ALONE: dict = {}


def alone(csm, adapter, frames: int = FRAMES, text: str = TEXT, **kw) -> np.ndarray:
    key = (id(csm), adapter, frames, text, tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _ALONE:
        kw.setdefault("temperature", 0)
        _ALONE[key] = csm.generate(text, adapter=adapter, max_audio_length_ms=frames * 80, **kw).codes
    return _ALONE[key]


class Stream:
    """A long pcm request in a thread (greedy): its bytes and codes once done."""

    def __init__(self, server, model: str = "ann", frames: int = LONG) -> None:
        self.server, self.model, self.frames = server, model, frames
        self.started, self.pcm, self.status, self.rid = threading.Event(), b"", None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60)

    def _run(self) -> None:
        body = {"model": self.model, "voice": "alloy", "input": "A longer sentence that keeps streaming.",
                "response_format": "pcm", "temperature": 0, "max_audio_length_ms": self.frames * 80}
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/audio/speech", json=body, timeout=120) as r:
                self.status, self.rid = r.status_code, r.headers.get("x-request-id")
                for data in r.iter_bytes():
                    self.pcm += data
                    self.started.set()
                    time.sleep(0.02)  # a reader at its own pace: the stream outlives the calls made meanwhile
        finally:
            self.started.set()

    def check(self, csm) -> None:
        """Whole (every frame's audio) and unchanged (the codes it gets alone)."""
        self.thread.join(120)
        assert self.status == 200 and len(self.pcm) == self.frames * 1920 * 2
        got = np.concatenate(self.server.codes.pop(self.rid))
        np.testing.assert_array_equal(got, alone(csm, self.model, self.frames,
                                                 "A longer sentence that keeps streaming."))


def post(server, path: str, body, headers=None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


# ---------------------------------------------------------------- model -> adapter
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_the_openai_client_s_model_picks_the_adapter(lserver, lcsm, sampling):
    for name in ("ann", "bob"):
        np.testing.assert_array_equal(speech_codes(lserver, name, **sampling), alone(lcsm, name, **sampling))
    assert not np.array_equal(alone(lcsm, "ann", **sampling), alone(lcsm, None, **sampling))


def test_the_base_s_names_keep_the_base(lserver, lcsm):
    for name in BASE_NAMES:
        np.testing.assert_array_equal(speech_codes(lserver, name), alone(lcsm, None))


def test_an_unknown_model_is_404_model_not_found(lserver):
    with pytest.raises(openai.NotFoundError) as e:
        client(lserver).audio.speech.create(model="kokoro", voice="alloy", input=TEXT)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "'kokoro'" in err["message"]
    assert "GET /v1/models" in err["message"]


# ---------------------------------------------------------------- the load / unload routes
def test_load_and_unload_while_a_stream_runs(lserver, lcsm):
    stream = Stream(lserver)
    r = post(lserver, "/v1/load_lora_adapter", {"lora_name": "cat", "lora_path": "cat"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cat" and r.json()["parent"] == "sesame/csm-1b" and r.json()["rank"] == 4
    assert "cat" in {m["id"] for m in httpx.get(f"{lserver.url}/v1/models").json()["data"]}
    np.testing.assert_array_equal(speech_codes(lserver, "cat"), alone(lcsm, "cat"))
    r = post(lserver, "/v1/unload_lora_adapter", {"lora_name": "cat"})
    assert r.status_code == 200 and r.json() == {"id": "cat", "object": "model", "deleted": True}
    r = post(lserver, "/v1/audio/speech", {"model": "cat", "voice": "alloy", "input": TEXT})
    err = error_of(r)
    assert r.status_code == 404 and err["code"] == "model_not_found" and "'cat'" in err["message"]
    assert "cat" not in {m["id"] for m in httpx.get(f"{lserver.url}/v1/models").json()["data"]}
    stream.check(lcsm)


def test_every_bad_load_is_refused_while_a_stream_runs(lserver, lcsm, root, tmp_path):
    bad = tmp_path / "bad"
    adapter_dir(root, "dora", 9, use_dora=True)
    adapter_dir(root, "big", 9, rank=16)
    other = tiny_config()
    adapter_dir(root, "other", 9, cfg=dataclasses.replace(other, backbone=dataclasses.replace(other.backbone, dim=96)))
    (root / "corrupt").mkdir(exist_ok=True)
    (root / "corrupt" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    adapter_dir(bad, "outside", 9)
    (root / "link").unlink(missing_ok=True)
    os.symlink(bad / "outside", root / "link")
    stream = Stream(lserver)
    cases = [  # (body, status, code, in the message)
        ({"lora_name": "x", "lora_path": "nope"}, 400, "invalid_adapter", "no such adapter directory"),
        ({"lora_name": "x", "lora_path": "corrupt"}, 400, "invalid_adapter", "cannot read it"),
        ({"lora_name": "x", "lora_path": "dora"}, 400, "invalid_adapter", "DoRA"),
        ({"lora_name": "x", "lora_path": "big"}, 400, "invalid_adapter", "rank 16 is over the pool's max_lora_rank 8"),
        ({"lora_name": "x", "lora_path": "other"}, 400, "invalid_adapter", "trained for a different base model"),
        ({"lora_name": "x", "lora_path": "../" + bad.name}, 403, "path_not_allowed", "outside"),
        ({"lora_name": "x", "lora_path": str(bad / "outside")}, 403, "path_not_allowed", "outside"),
        ({"lora_name": "x", "lora_path": "link"}, 403, "path_not_allowed", "outside"),
        ({"lora_name": "ann", "lora_path": "cat"}, 409, "adapter_exists", "already loaded"),
        ({"lora_name": "tts-1", "lora_path": "cat"}, 400, "invalid_adapter_name", "base model"),
        ({"lora_name": "a b", "lora_path": "cat"}, 400, "invalid_adapter_name", "letters, digits"),
        ({"lora_name": "x"}, 400, "missing_required_parameter", "lora_path"),
        ({"lora_name": "x", "lora_path": "~nosuchuser/cat"}, 400, "invalid_adapter", "no such adapter directory"),
        ({"lora_name": "x", "lora_path": "x" * 300}, 400, "invalid_adapter", "x" * 300),
    ]
    for body, status, code, words in cases:
        r = post(lserver, "/v1/load_lora_adapter", body)
        err = error_of(r)
        assert (r.status_code, err["code"]) == (status, code) and words in err["message"], (body, r.text)
        assert err["type"] == ("invalid_request_error" if status in (400, 404, 409) else "permission_error"), r.text
        assert "\n" not in err["message"]
    r = httpx.post(f"{lserver.url}/v1/load_lora_adapter", content=b'{"lora_name": "x", "lora_path": "cat"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415
    # more adapters than --max-cpu-loras (3): ann, bob, cat loaded; dan is one too many
    assert post(lserver, "/v1/load_lora_adapter", {"lora_name": "cat", "lora_path": "cat"}).status_code == 200
    r = post(lserver, "/v1/load_lora_adapter", {"lora_name": "dan", "lora_path": "dan"})
    assert r.status_code == 409 and error_of(r)["code"] == "too_many_adapters" and "max-cpu-loras" in r.text
    assert post(lserver, "/v1/unload_lora_adapter", {"lora_name": "cat"}).status_code == 200
    r = post(lserver, "/v1/unload_lora_adapter", {"lora_name": "cat"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    stream.check(lcsm)
    assert set(lcsm.adapters) == {"ann", "bob"}


def test_the_load_route_is_off_without_lora_dir_and_behind_the_api_key(lcsm, tmp_path, root):
    s = Server(create_app(lcsm, ServerConfig(voices_db=str(tmp_path / "v.db"), api_key="k"))).start()
    try:
        body = {"lora_name": "cat", "lora_path": str(root / "cat")}
        r = post(s, "/v1/load_lora_adapter", body)
        assert r.status_code == 401
        r = post(s, "/v1/load_lora_adapter", body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 403 and error_of(r)["code"] == "lora_loading_disabled" and "--lora-dir" in r.text
        r = post(s, "/v1/unload_lora_adapter", {"lora_name": "ann"})
        assert r.status_code == 401
    finally:
        s.stop()
    assert set(lcsm.adapters) == {"ann", "bob"}


def test_a_server_without_a_pool_refuses_adapter_names(csm, serve):
    """The session's engine has no LoRA pool (max_loras 0): a model naming no base is a 404, the routes a 400."""
    s = serve(lora_dir="/tmp")
    r = post(s, "/v1/audio/speech", {"model": "ann", "voice": "alloy", "input": TEXT})
    assert r.status_code == 404 and "serves no LoRA adapters" in error_of(r)["message"]
    r = post(s, "/v1/load_lora_adapter", {"lora_name": "ann", "lora_path": "ann"})
    assert r.status_code == 400 and error_of(r)["code"] == "lora_disabled"
    assert post(s, "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": TEXT}).status_code == 200


def test_models_list_the_base_and_the_adapters(lserver):
    data = httpx.get(f"{lserver.url}/v1/models").json()
    assert data["object"] == "list"
    by_id = {m["id"]: m for m in data["data"]}
    assert set(BASE_NAMES) <= set(by_id) and {"ann", "bob"} <= set(by_id)
    ann = by_id["ann"]
    assert ann["object"] == "model" and ann["parent"] == "sesame/csm-1b" and ann["root"].endswith("ann")
    assert "parent" not in by_id["tts-1"]
    assert httpx.get(f"{lserver.url}/v1/models/ann").json()["parent"] == "sesame/csm-1b"
    assert httpx.get(f"{lserver.url}/v1/models/nope").status_code == 404
    assert {"ann", "tts-1"} <= {m["id"] for m in httpx.get(f"{lserver.url}/v1/audio/models").json()["models"]}


# ---------------------------------------------------------------- voices bound to an adapter
def create_voice(server, name: str, adapter: str | None) -> httpx.Response:
    data = {"name": name, "transcript": "A reference clip.", "speaker": "1"}
    if adapter is not None:
        data["adapter"] = adapter
    return httpx.post(f"{server.url}/v1/audio/voices", data=data,
                      files={"audio_sample": ("clip.wav", wav_bytes(0.5), "audio/wav")}, timeout=60)


def test_a_voice_bound_to_an_adapter(lserver, lcsm):
    r = create_voice(lserver, "annie", "ann")
    assert r.status_code == 200 and r.json()["adapter"] == "ann"
    listed = {v["name"]: v for v in httpx.get(f"{lserver.url}/v1/audio/voices").json()["voices"]}
    assert listed["annie"]["adapter"] == "ann"
    voice = lserver.state.store.get("annie")
    ref = {a: lcsm.generate(TEXT, speaker=1, context=[Segment.of_voice(voice)], adapter=a, temperature=0,
                            max_audio_length_ms=FRAMES * 80).codes for a in ("ann", "bob", None)}
    # voice alone: its adapter; a base name in model does not change that; a model naming another adapter wins
    np.testing.assert_array_equal(speech_codes(lserver, "tts-1", voice="annie"), ref["ann"])
    np.testing.assert_array_equal(speech_codes(lserver, "bob", voice="annie"), ref["bob"])
    assert not np.array_equal(ref["ann"], ref[None])
    r = create_voice(lserver, "ghost", "nope")
    assert r.status_code == 404 and error_of(r)["param"] == "adapter"
    r = create_voice(lserver, "ghost", "bad name")
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_adapter_name"
    # its adapter unloaded: the voice's requests are refused (404), load it again and they speak
    assert post(lserver, "/v1/unload_lora_adapter", {"lora_name": "ann"}).status_code == 200
    try:
        r = post(lserver, "/v1/audio/speech", {"model": "tts-1", "voice": "annie", "input": TEXT})
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found" and "'ann'" in r.text
    finally:
        assert post(lserver, "/v1/load_lora_adapter", {"lora_name": "ann", "lora_path": "ann"}).status_code == 200


def test_a_dialogue_s_voices_bound_to_two_adapters_need_a_model(lserver):
    assert create_voice(lserver, "bobby", "bob").status_code == 200
    assert create_voice(lserver, "annie2", "ann").status_code == 200
    body = {"model": "tts-1", "voice": "alloy", "input": "[S1] Hi. [S2] Hello.", "voices": ["annie2", "bobby"],
            "response_format": "pcm", "max_audio_length_ms": 480}
    r = post(lserver, "/v1/audio/speech", body)
    assert r.status_code == 400 and error_of(r)["code"] == "adapter_conflict"
    r = post(lserver, "/v1/audio/speech", {**body, "model": "bob"})
    assert r.status_code == 200 and lserver.codes.pop(r.headers["x-request-id"])


# ---------------------------------------------------------------- the WebSocket
def ws_turn(ws) -> list[dict]:
    msgs = []
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str):
            msgs.append(json.loads(msg))
            if msgs[-1]["type"] in ("flush_done", "error"):
                return msgs


def test_the_websocket_s_model(lserver, lcsm):
    url = lserver.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    settings = {"temperature": 0, "max_audio_length_ms": FRAMES * 80, "max_segment_length_ms": FRAMES * 80}
    want = {a: np.concatenate([c.codes for c in lcsm.speak(TEXT, adapter=a, **settings)]) for a in ("ann", None)}
    with connect(url) as ws:
        for cid, key, model in (("w-ann", "model", "ann"), ("w-adapter", "adapter", "ann"),
                                ("w-base", "model", "tts-1")):
            ws.send(json.dumps({"context_id": cid, key: model, "text": TEXT, "flush": True, **settings}))
            done = ws_turn(ws)[-1]
            assert done["type"] == "flush_done", done
            turn = lserver.state.sessions.get(cid).turns[-1]
            got = np.concatenate([s.codes for s in turn.segments]).astype(np.int64)
            np.testing.assert_array_equal(got, want["ann" if model == "ann" else None])
        ws.send(json.dumps({"context_id": "w-x", "model": "nope", "text": TEXT, "flush": True}))
        err = ws_turn(ws)[-1]
        assert err["type"] == "error" and err["context_id"] == "w-x" and err["error"]["code"] == "model_not_found"
        ws.send(json.dumps({"context_id": "w-ann", "text": TEXT, "flush": True}))  # the connection goes on
        assert ws_turn(ws)[-1]["type"] == "flush_done"


# ---------------------------------------------------------------- metrics
def series(server, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and 'adapter="' in line:
            out[line.split('adapter="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_per_adapter(lserver):
    before = series(lserver, "csmserve:lora_requests_total").get("bob", 0)
    speech_codes(lserver, "bob")
    deadline = time.time() + 5
    while series(lserver, "csmserve:lora_requests_total").get("bob", 0) < before + 1 and time.time() < deadline:
        time.sleep(0.05)  # (the engine's snapshot refreshes every 0.5 s)
    assert series(lserver, "csmserve:lora_requests_total")["bob"] >= before + 1
    assert series(lserver, "csmserve:lora_generated_frames_total")["bob"] >= FRAMES
    assert series(lserver, "csmserve:lora_loads_total")["bob"] >= 1
    assert "bob" in series(lserver, "csmserve:lora_load_seconds_total")
    assert post(lserver, "/v1/load_lora_adapter", {"lora_name": "cat", "lora_path": "cat"}).status_code == 200
    assert "cat" in series(lserver, "csmserve:lora_requests_total")
    assert post(lserver, "/v1/unload_lora_adapter", {"lora_name": "cat"}).status_code == 200
    assert "cat" not in series(lserver, "csmserve:lora_requests_total")  # an unloaded adapter's series go


# ---------------------------------------------------------------- a full pool
def test_a_full_pool_waits_then_503_while_the_running_stream_goes_on(root, tmp_path):
    """One pool slot held by ann's running stream: bob's request waits --max-lora-wait-s (0.5 s) in the queue, then
    503 adapter_pool_full; ann's stream ends whole; then bob's request is served."""
    cfg = EngineConfig(max_slots=4, max_seq_len=512, first_chunk_frames=1, chunk_frames=2, max_loras=1,
                       max_lora_rank=8, max_lora_wait_s=0.5)
    small = CSM("dummy-tiny", device="cpu", dtype="float32", engine_config=cfg,
                adapters={"ann": str(root / "ann"), "bob": str(root / "bob")})
    step = small.engine.runner.step

    def slow_step(*a, **kw):  # >= 50 ms a frame (4 s for ann's 80) however fast the CPU: it outlives the 0.5 s wait
        time.sleep(0.05)
        return step(*a, **kw)

    small.engine.runner.step = slow_step
    s = Server(create_app(small, ServerConfig(voices_db=str(tmp_path / "v.db")))).start()
    s.codes = record(s.state)
    try:
        stream = Stream(s, "ann", frames=80)
        t0 = time.perf_counter()
        r = post(s, "/v1/audio/speech", {"model": "bob", "voice": "alloy", "input": TEXT, "max_audio_length_ms": 480})
        waited = time.perf_counter() - t0
        # ann's stream still held the slot all that time
        assert stream.thread.is_alive(), (stream.status, len(stream.pcm), waited, r.status_code, r.text[:200])
        err = error_of(r)
        assert r.status_code == 503 and err["code"] == "adapter_pool_full" and "--max-loras" in err["message"]
        assert 0.5 <= waited < 10
        stream.check(small)
        r = post(s, "/v1/audio/speech", {"model": "bob", "voice": "alloy", "input": TEXT, "max_audio_length_ms": 480})
        assert r.status_code == 200
    finally:
        s.stop()
        small.close()


# ---------------------------------------------------------------- csmserve serve --lora (processes)
def test_serve_lora_as_processes(root, tmp_path):
    """`csmserve serve --lora ann=DIR --lora-dir ROOT` with an API worker process (CSM.attach): the adapter is served
    from the start, a request's model picks it, the load / unload routes and the metrics reach the engine process."""
    server = ProcServer(tmp_path, workers=1, lora=f"ann={root / 'ann'}", lora_dir=str(root), max_lora_rank=8,
                        max_loras=2).start()
    try:
        ids = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert ids["ann"]["parent"] == "sesame/csm-1b"
        body = {"voice": "alloy", "input": TEXT, "response_format": "pcm", "temperature": 0,
                "max_audio_length_ms": FRAMES * 80}
        pcm = {m: post(server, "/v1/audio/speech", {**body, "model": m}).content for m in ("ann", "tts-1")}
        assert len(pcm["ann"]) == len(pcm["tts-1"]) == FRAMES * 1920 * 2 and pcm["ann"] != pcm["tts-1"]
        assert post(server, "/v1/audio/speech", {**body, "model": "ann"}).content == pcm["ann"]
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "cat", "lora_path": "cat"})
        assert r.status_code == 200, r.text
        assert post(server, "/v1/audio/speech", {**body, "model": "cat"}).status_code == 200
        assert series(server, "csmserve:lora_requests_total").keys() == {"ann", "cat"}
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "cat"}).status_code == 200
        r = post(server, "/v1/audio/speech", {**body, "model": "cat"})
        assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nope"})
        assert r.status_code == 400 and "no such adapter directory" in error_of(r)["message"]
    finally:
        server.stop()


def test_serve_with_a_bad_lora_ends_with_its_one_line(root, tmp_path):
    """An adapter the command line cannot judge (another base shape: its tensors) fails the engine's start: `csmserve
    serve` exits 2 with the reason in one line, not a server answering 503."""
    import subprocess
    import sys

    other = tiny_config()
    adapter_dir(tmp_path, "other", 1, cfg=dataclasses.replace(other, backbone=dataclasses.replace(other.backbone,
                                                                                                    dim=96)))
    from server_helpers import free_port

    p = subprocess.run([sys.executable, "-m", "csmserve", "serve", "--model", "dummy-tiny", "--device", "cpu",
                        "--api-workers", "1", "--port", str(free_port()), "--voices-db", str(tmp_path / "v.db"),
                        "--log-level", "warning", "--lora", f"x={tmp_path / 'other'}"],
                       capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith("csmserve serve: error: the engine failed to start: LoraError")
    assert "trained for a different base model" in last
