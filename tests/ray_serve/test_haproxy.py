"""The ingress's HAProxy (csmserve/ray/haproxy.py) with its generated config, in front of stand-in replicas
(small HTTP servers that say who they are): routing by key as the old proxy middleware did, the body limit,
bounded loads, health checks, reloads in place, and errors in OpenAI's shape. No Ray, no model."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from server_helpers import free_port

haproxy = pytest.importorskip("csmserve.ray.haproxy")
try:
    BINARY = haproxy.binary()
except Exception as e:  # noqa: BLE001
    pytest.skip(f"no HAProxy ({e})", allow_module_level=True)

MODELS = ("dummy-tiny", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
ALIASES = ("alloy", "echo", "nova")


class Replica(ThreadingHTTPServer):
    """A stand-in replica: every response names it (x-csmserve-replica); a speech body's `hold_s` keeps the
    response open that long (an ongoing stream); /health answers 200 while `healthy`."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        self.name, self.healthy, self.seen = name, True, 0
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def server(self) -> haproxy.Server:
        return haproxy.Server(self.name, "127.0.0.1", self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._send(200 if self.server.healthy else 503, b"{}")
        self.server.seen += 1
        self._send(200, self.server.name.encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.seen += 1
        try:
            req = json.loads(body)
            hold, stream = float(req.get("hold_s", 0)), bool(req.get("stream"))
        except (ValueError, AttributeError):
            hold, stream = 0.0, False
        if stream:  # a first small chunk (one frame of audio), then the rest after hold_s: a stream's start
            self.send_response(200)
            self.send_header("x-csmserve-replica", self.server.name)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for chunk in (b"x" * 3840, b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                time.sleep(hold)
            return
        time.sleep(hold)
        self._send(200, self.server.name.encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("x-csmserve-replica", self.server.name)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, OSError):
            self.close_connection = True


class Control(ThreadingHTTPServer):
    """The ingress actor's control port, as HAProxy sees it."""

    daemon_threads = True

    def __init__(self) -> None:
        class H(_Handler):
            def do_GET(self) -> None:
                self._send(200, f"control {self.path}".encode())

        self.name, self.seen = "control", 0
        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class Proxy:
    def __init__(self, tmp: Path, replicas: list[Replica], body_bytes: int = 256 << 10) -> None:
        self.port, self.control = free_port(), Control()
        self.frontend = haproxy.Frontend("127.0.0.1", self.port, self.control.server_address[1], MODELS, ALIASES,
                                         body_bytes=body_bytes, threads=1)
        self.proxy = haproxy.HAProxy(BINARY, tmp)
        self.proxy.start(haproxy.render(self.frontend, [r.server for r in replicas]), "127.0.0.1", self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def set(self, replicas: list[Replica]) -> None:
        self.proxy.reload(haproxy.render(self.frontend, [r.server for r in replicas]))

    def speak(self, headers: dict | None = None, params: dict | None = None, **body) -> str:
        r = httpx.post(f"{self.url}/v1/audio/speech", json={"input": "Hi.", **body}, headers=headers,
                       params=params, timeout=30)
        assert r.status_code == 200, r.text
        return r.headers["x-csmserve-replica"]


@pytest.fixture
def replicas():
    rs = [Replica(f"r{i}") for i in range(4)]
    yield rs
    for r in rs:
        r.shutdown()
        r.server_close()


@pytest.fixture
def proxy(tmp_path, replicas):
    p = Proxy(tmp_path, replicas)
    yield p
    p.proxy.stop()


def test_the_generated_config_is_valid_and_sized(tmp_path, replicas):
    f = haproxy.Frontend("0.0.0.0", 8000, 9000, MODELS, ALIASES, body_bytes=1 << 20, load_factor=1.5)
    text = haproxy.render(f, [r.server for r in replicas])
    assert haproxy.HAProxy(BINARY, tmp_path).check(text) is None
    assert haproxy.HAProxy(BINARY, tmp_path).check(haproxy.render(f, [])) is None  # no replica yet: valid too
    assert "tune.bufsize 1048576" in text and "hash-balance-factor 150" in text
    # every ingress (and every reload) gives a replica the same id: the same place on the hash ring
    assert haproxy.server_ids(["b", "a", "c"]) == haproxy.server_ids(["c", "a", "b"])
    assert haproxy.server_ids(["a", "b"])["a"] == haproxy.server_ids(["a", "c", "d"])["a"]


def test_conversations_stay_on_their_replica_by_body_url_or_header(proxy):
    homes = {}
    for cid in (f"talk-{i}" for i in range(12)):
        homes[cid] = proxy.speak(context_id=cid)
        assert {proxy.speak(context_id=cid, voice="alloy") for _ in range(3)} == {homes[cid]}
        # the WebSocket's ?context_id= (a GET upgrade) lands where the body's context_id does
        r = httpx.get(f"{proxy.url}/v1/audio/speech/stream", params={"context_id": cid})
        assert r.headers["x-csmserve-replica"] == homes[cid]
    assert len(set(homes.values())) >= 3  # the ring spreads conversations
    # a client's own x-session-id wins over the body's context_id
    cid = "talk-0"
    other = next(c for c, h in homes.items() if h != homes[cid])
    assert proxy.speak(headers={"x-session-id": other}, context_id=cid) == homes[other]


def test_voices_first_turns_and_adapters_prefer_their_replica_aliases_spread(proxy):
    for voice in ("voice_a1", "voice_b2", {"id": "voice_c3"}):
        assert len({proxy.speak(voice=voice, input=f"Line {i}.") for i in range(4)}) == 1, voice
    first = {"speaker": 1, "text": "How are you?", "audio": "UklGRg" * 50}
    turns = [[first], [first, {"speaker": 0, "text": "Fine."}], [first, {"text": "Fine."}, {"text": "And you?"}]]
    assert len({proxy.speak(voice="alloy", context=c) for c in turns}) == 1  # a conversation sent turn by turn
    assert len({proxy.speak(voice="alloy", context=[{**first, "text": f"Other {i}"}]) for i in range(12)}) >= 2
    for model in ("ann", "bob-v2"):
        assert len({proxy.speak(model=model, voice="alloy") for _ in range(4)}) == 1, model
    # the base model and OpenAI's voices carry no prefix: least connections, idle replicas in turn
    assert {proxy.speak(model="tts-1", voice="alloy") for _ in range(8)} == {"r0", "r1", "r2", "r3"}
    assert {proxy.speak(model="dummy-tiny", voice="NOVA") for _ in range(8)} == {"r0", "r1", "r2", "r3"}


def test_a_hot_voice_spills_past_the_load_bound(proxy):
    """Consistent hashing with bounded loads: 8 at once of one voice do not queue on its one replica."""
    home = proxy.speak(voice="voice_hot")
    results: list[str] = []
    threads = [threading.Thread(target=lambda i=i: results.append(proxy.speak(voice="voice_hot", hold_s=1.0)))
               for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    counts = Counter(results)
    assert len(counts) >= 2 and counts[home] < 8 and counts[home] == max(counts.values()), counts


def test_a_streams_first_chunk_passes_at_once(proxy):
    """HAProxy holds small sends for a fuller packet unless told not to (option http-no-delay): a stream's first
    chunk must reach the client when the replica writes it, not when more follows."""
    waits = []
    for _ in range(5):
        t0 = time.perf_counter()
        with httpx.stream("POST", f"{proxy.url}/v1/audio/speech", json={"input": "Hi.", "stream": True, "hold_s": 0.5},
                          timeout=30) as r:
            assert len(next(r.iter_raw())) > 0
            waits.append(time.perf_counter() - t0)
    assert sorted(waits)[2] < 0.1, waits


def test_a_key_past_the_body_limit_goes_to_the_least_loaded(tmp_path, replicas):
    p = Proxy(tmp_path, replicas, body_bytes=16384)
    try:
        pad = "x" * 20000
        keyed = {p.speak(context_id="talk-x", pad=pad) for _ in range(4)}  # the key within the first 16 KB
        assert len(keyed) == 1
        late = [p.speak(pad=pad, context_id="talk-x") for _ in range(8)]  # after them: not seen
        assert set(late) == {"r0", "r1", "r2", "r3"}
    finally:
        p.proxy.stop()


def test_control_paths_go_to_the_ingress_health_to_a_replica(proxy):
    for path in ("/ready", "/metrics", "/-/healthz"):
        assert httpx.get(proxy.url + path).text == f"control {path}"
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # refused there (--ray: --lora at start)
        r = httpx.post(proxy.url + path, json={"lora_name": "ann", "lora_path": "ann"})
        assert r.headers["x-csmserve-replica"] == "control"
    assert httpx.get(proxy.url + "/health").headers["x-csmserve-replica"] in {"r0", "r1", "r2", "r3"}


def test_an_unhealthy_replica_is_taken_out_and_its_keys_move(proxy, replicas):
    homes = {cid: proxy.speak(context_id=cid) for cid in (f"c{i}" for i in range(16))}
    sick = replicas[0]
    sick.healthy = False
    time.sleep(2.5)  # two failed checks (1 s apart, 250 ms once failing)
    moved = {cid: proxy.speak(context_id=cid) for cid in homes}
    assert "r0" not in moved.values()
    assert all(moved[c] == h for c, h in homes.items() if h != "r0")  # only the sick replica's keys moved
    sick.healthy = True
    time.sleep(1.5)
    assert {c: proxy.speak(context_id=c) for c in homes} == homes  # back on the ring where it was


def test_a_reload_keeps_open_streams_and_moves_only_the_lost_replicas_keys(proxy, replicas):
    homes = {cid: proxy.speak(context_id=cid) for cid in (f"k{i}" for i in range(16))}
    held: dict = {}
    t = threading.Thread(target=lambda: held.update(r=proxy.speak(context_id="k0", hold_s=2.0)))
    t.start()
    time.sleep(0.5)
    proxy.set(replicas[:3])  # r3 leaves
    errors = 0
    for _ in range(20):  # new connections during and after the reload
        try:
            httpx.get(proxy.url + "/v1/models", timeout=5).raise_for_status()
        except httpx.HTTPError:
            errors += 1
    t.join()
    assert held["r"] == homes["k0"] and errors == 0
    moved = {cid: proxy.speak(context_id=cid) for cid in homes}
    assert "r3" not in moved.values()
    assert all(moved[c] == h for c, h in homes.items() if h != "r3")
    proxy.set(replicas)
    assert {c: proxy.speak(context_id=c) for c in homes} == homes


def test_a_reload_returns_once_new_connections_get_the_new_config(tmp_path, replicas):
    """The first request after `reload` reaches the replicas of the new config, never the old worker's (its 503
    with none, its replica otherwise): what lets the ingress call a replica routed (/ready) as reload returns."""
    p = Proxy(tmp_path, [])
    try:
        for r in replicas:  # each reload routes to that replica alone
            p.set([r])
            with socket.create_connection(("127.0.0.1", p.port)) as sock:  # at once (httpx takes ~10 ms to start)
                sock.sendall(f"GET {haproxy.CONFIG_PATH} HTTP/1.0\r\n\r\n".encode())
                assert sock.makefile("rb").read().endswith(haproxy.config_id([r.server]).encode())
            assert p.speak() == r.name
    finally:
        p.proxy.stop()


def test_no_replica_is_a_503_in_openais_shape(tmp_path):
    p = Proxy(tmp_path, [])
    try:
        r = httpx.post(f"{p.url}/v1/audio/speech", json={"input": "Hi."})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_ready"
    finally:
        p.proxy.stop()
