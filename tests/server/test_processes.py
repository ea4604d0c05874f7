"""`csmserve serve --api-workers 2`: an engine-core process and two API workers, as users run it.

What only exists with several processes: a worker killed mid-stream does not stop the other (and is
started again); the engine process killed turns /health and /ready 503 at once and ends the open
streams with an error, one that hangs turns them 503 after --engine-stall-s and keeps the streams;
sessions, voices, metrics and the API key are the same whichever worker a request lands on (the
`X-Csmserve-Worker` header says which one served it).
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import struct
import threading
import time

import httpx
import pytest
from websockets.sync.client import connect

from server_helpers import ProcServer, metric, wait_idle, wav_bytes
from test_ws import turn

SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm"}


@pytest.fixture
def procs(tmp_path):
    servers = []

    def start(**flags) -> ProcServer:
        s = ProcServer(tmp_path, **flags).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def _stream(url: str, out: dict, key: int, ms: int, started: threading.Event | None = None) -> None:
    """One streaming request; out[key] = (status, bytes received, completed, worker); `started` is set at
    its first audio."""
    n, done, worker, status = 0, False, None, None
    try:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": ms},
                          timeout=60) as r:
            status, worker = r.status_code, r.headers.get("x-csmserve-worker")
            for part in r.iter_bytes():
                n += len(part)
                if started is not None and n:
                    started.set()
            done = True
    except httpx.HTTPError:
        pass
    out[key] = (status, n, done, worker)


def _served_by_each_worker(url: str, workers: int = 2, tries: int = 60) -> set[str]:
    seen = set()
    for _ in range(tries):
        seen.add(httpx.get(f"{url}/v1/models", timeout=10).headers["x-csmserve-worker"])
        if len(seen) == workers:
            break
    return seen


def test_killing_one_api_worker_leaves_the_other_serving(procs):
    server = procs()
    assert _served_by_each_worker(server.url) == {"0", "1"}
    # keep-alive connections open at once are spread over the workers (server/dispatch.py)
    clients = [httpx.Client(base_url=server.url, timeout=10) for _ in range(6)]
    served = sorted(c.get("/v1/models").headers["x-csmserve-worker"] for c in clients)
    assert served == ["0", "0", "0", "1", "1", "1"], served
    for c in clients:
        c.close()
    pids = server.pids()
    out: dict = {}
    threads = [threading.Thread(target=_stream, args=(server.url, out, i, 8000)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every stream is running
    os.kill(pids["workers"][0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    served = {k: v for k, v in out.items() if v[0] == 200}
    by_survivor = [v for v in served.values() if v[3] == "1"]
    assert by_survivor and all(v[2] and v[1] == 8000 // 80 * 1920 * 2 for v in by_survivor), out
    # the dead worker's requests were aborted in the engine: every slot free again
    assert wait_idle(server, timeout=20)
    # the worker is started again; both serve
    deadline = time.time() + 60
    while time.time() < deadline and server.pids()["workers"][0] == pids["workers"][0]:
        time.sleep(0.2)
    assert server.pids()["workers"][0] != pids["workers"][0]
    assert _served_by_each_worker(server.url) == {"0", "1"}
    r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": 160}, timeout=60)
    assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2


def _clients_on(url: str, want: dict[str, int], tries: int = 40) -> dict[str, list[httpx.Client]]:
    """Keep-alive clients, `want[worker]` of them on each worker (a connection stays with the worker it was handed
    to; a new one, as a client's second connection would be, may land on any)."""
    by: dict[str, list[httpx.Client]] = {w: [] for w in want}
    for _ in range(tries):
        c = httpx.Client(base_url=url, timeout=30)
        w = c.get("/v1/models").headers["x-csmserve-worker"]
        if len(by[w]) < want[w]:
            by[w].append(c)
        else:
            c.close()
        if all(len(by[w]) == n for w, n in want.items()):
            return by
    raise AssertionError(f"not {want} clients: {by}")


def _stream_on(client: httpx.Client, got: list, ms: int, stop: threading.Event) -> None:
    """A streaming request on `client`'s connection; got[0]: bytes received so far; until the end or `stop`."""
    try:
        with client.stream("POST", "/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": ms}) as r:
            for part in r.iter_bytes():
                got[0] += len(part)
                if stop.is_set():
                    break
    except httpx.HTTPError:
        pass


def test_a_frozen_api_worker_is_dropped_and_the_other_keeps_serving(procs):
    """An API worker frozen (SIGSTOP: a cgroup freezer, swapped out) stops reading its connection to the engine;
    with a stream of its own every step sends it a message, and its socket fills within seconds. The engine's
    sends to it give up past --reader-wait-s and drop it (a blocking send stopped the engine loop: every stream of
    every worker froze with it). The other worker keeps serving throughout; the frozen one, once it runs again,
    finds its link closed with the engine alive: it exits and is started again."""
    server = procs(reader_wait_s=0.5)
    frozen = server.pids()["workers"][1]
    by = _clients_on(server.url, {"0": 2, "1": 1})
    stop = threading.Event()
    got0, got1 = [0], [0]
    streams = [threading.Thread(target=_stream_on, args=(by["1"][0], got1, 20_000, stop)),
               threading.Thread(target=_stream_on, args=(by["0"][1], got0, 20_000, stop))]
    for t in streams:
        t.start()
    deadline = time.time() + 30
    while not (got0[0] and got1[0]):  # both streaming: worker 1 has a row in every step
        assert time.time() < deadline, (got0, got1)
        time.sleep(0.05)
    os.kill(frozen, signal.SIGSTOP)
    try:
        t0, served, seen, t_seen, t_dropped = time.time(), 0, got0[0], time.time(), None
        # until the engine has dropped the frozen worker (its socket full: where the engine blocked) and 2 s more:
        # worker 0 answers every request, and its open stream keeps receiving audio
        while t_dropped is None or time.time() - t_dropped < 2:
            r = by["0"][0].post("/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": 240}, timeout=10)
            assert r.status_code == 200 and len(r.content) == 3 * 1920 * 2, r.text
            served += 1
            if got0[0] > seen or got0[0] == 20_000 // 80 * 1920 * 2:
                seen, t_seen = got0[0], time.time()
            assert time.time() - t_seen < 5, f"worker 0's open stream got nothing for 5 s ({served} requests served)"
            if t_dropped is None and "fell behind (its connection full" in server.log_path.read_text():
                t_dropped = time.time()
            assert time.time() - t0 < 60, f"worker 1 not dropped in 60 s ({served} requests served by worker 0)"
    finally:
        os.kill(frozen, signal.SIGCONT)
    stop.set()
    for t in streams:
        t.join(30)
    # running again, worker 1 exits (one line) and is started again; both ready
    deadline = time.time() + 30
    while server.pids()["workers"][1] == frozen:
        assert time.time() < deadline, "the dropped worker was not started again"
        time.sleep(0.2)
    ready: set[str] = set()
    while ready != {"0", "1"}:
        assert time.time() < deadline, f"/ready 200 from {sorted(ready)} only"
        r = httpx.get(f"{server.url}/ready", timeout=5)
        if r.status_code == 200:
            ready.add(r.headers["x-csmserve-worker"])
        time.sleep(0.05)
    for c in [*by["0"], *by["1"]]:
        c.close()
    assert wait_idle(server, timeout=20)  # the dropped worker's request aborted at the engine
    log = server.log_path.read_text()
    assert log.count("the engine dropped this worker (it fell behind): exiting to be restarted") == 1, log[-3000:]
    assert log.count("fell behind (its connection full") == 1 and "engine_failed" not in log, log[-3000:]


def test_killing_the_engine_process_turns_health_503_at_once_and_ends_open_streams(procs):
    server = procs()  # both workers attached (ProcServer.start)
    # keep-alive connections opened one after another go to the worker with the fewest open, so these reach
    # both (a new connection per poll would land on whichever has fewer open: one worker only, at times)
    clients = [httpx.Client(base_url=server.url, timeout=5) for _ in range(4)]
    assert {c.get("/v1/models").headers["x-csmserve-worker"] for c in clients} == {"0", "1"}
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(server.url, out, 0, 20_000, started))  # fits --max-seq-len 512
    t.start()
    assert started.wait(30)  # audio is streaming (a kill before the first audio is a 500 instead)
    os.kill(server.pids()["engine"], signal.SIGKILL)
    t0 = time.time()
    down: set[str] = set()
    while len(down) < 2:  # each worker learns from its own link to the engine (EOF): ms apart, not a timeout
        for c in clients:
            r = c.get("/health")
            if r.status_code == 503:
                down.add(r.headers["x-csmserve-worker"])
        assert time.time() - t0 < 3, f"health still 200 (503 from workers {sorted(down)} only)"
        time.sleep(0.02)
    for c in clients:
        c.close()
    for route in ("/health", "/ready"):  # from both workers
        for _ in range(6):
            r = httpx.get(f"{server.url}{route}", timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    t.join(10)
    assert not t.is_alive() and out[0][0] == 200 and not out[0][2]  # ended, not hung, not complete
    r = httpx.post(f"{server.url}/v1/audio/speech", json=SPEECH, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def test_a_hung_engine_process_turns_health_503_until_it_sends_again_and_keeps_the_streams(procs):
    """The engine process stopped (SIGSTOP: a GPU hang, a deadlock) keeps its connections open: no EOF tells the
    worker. Past --engine-stall-s without a step or heartbeat, /health and /ready answer 503 engine_stalled (so an
    orchestrator restarts it); once it sends again, 200; the stream open through the stall ends complete."""
    server = procs(workers=1, engine_stall_s=1)
    engine = server.pids()["engine"]
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(server.url, out, 0, 20_000, started))  # fits --max-seq-len 512
    t.start()
    assert started.wait(30)

    def probe(want: int, within: float) -> None:
        t0 = time.time()
        while (r := httpx.get(f"{server.url}/health", timeout=5)).status_code != want:
            assert time.time() - t0 < within, f"/health still {r.status_code}: {r.text}"
            time.sleep(0.05)

    os.kill(engine, signal.SIGSTOP)
    try:
        probe(503, 3)
        assert t.is_alive()  # open through the stall
        for route in ("/health", "/ready"):
            r = httpx.get(f"{server.url}{route}", timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
    finally:
        os.kill(engine, signal.SIGCONT)
    probe(200, 3)
    assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
    t.join(60)
    assert not t.is_alive() and out[0][:3] == (200, 20_000 // 80 * 1920 * 2, True), out
    log = server.log_path.read_text()
    assert log.count("has sent nothing for") == 1 and log.count("sends again after") == 1, log[-3000:]


def test_the_engine_and_the_workers_exit_when_the_parent_is_killed(procs):
    """SIGKILL of `csmserve serve` (its shutdown never runs): the engine notices its parent gone
    (EngineSpec.parent_pid), removes its shared-memory ring and socket, and exits: no orphan on the GPU;
    the API workers exit too (WorkerSpec.parent_pid): none is left holding the port."""
    from pathlib import Path

    server = procs(workers=1)
    engine, workers = server.pids()["engine"], list(server.pids()["workers"].values())
    ring = list(Path("/dev/shm").glob(f"csmserve-{server.proc.pid}-*"))
    assert len(ring) == 1 and Path(f"/proc/{engine}").exists()
    server.proc.kill()
    server.proc.wait(10)
    try:
        deadline = time.time() + 10
        while Path(f"/proc/{engine}").exists() and "zombie" not in _status(engine):
            assert time.time() < deadline, "the engine outlived its parent"
            time.sleep(0.1)
        assert not ring[0].exists()
        assert "the process that started the engine" in server.log_path.read_text()  # its own exit, not a kill
        for pid in workers:
            while Path(f"/proc/{pid}").exists() and "zombie" not in _status(pid):
                assert time.time() < deadline, "an API worker outlived its parent"
                time.sleep(0.1)
        assert "the process that started API worker 0" in server.log_path.read_text()
        while not _can_listen(server.port):  # the port is free again: a restarted server can bind it
            assert time.time() < deadline, "the port is still held"
            time.sleep(0.1)
    finally:
        for pid in workers:  # a worker that did not exit: the test's clean-up
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _can_listen(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _status(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/status").read().lower()
    except OSError:
        return ""


def test_sessions_voices_metrics_and_keys_are_the_same_on_every_worker(procs):
    server = procs(api_key="k")
    auth = {"Authorization": "Bearer k"}
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    # a voice created through one worker is used through the other
    v = httpx.post(f"{server.url}/v1/audio/voices", headers=auth, timeout=60,
                   files={"audio_sample": ("v.wav", wav_bytes(1.0), "audio/wav")},
                   data={"name": "shared", "transcript": "A test voice."}).json()
    workers = set()
    for _ in range(20):
        r = httpx.post(f"{server.url}/v1/audio/speech", headers=auth, timeout=60,
                       json={**SPEECH, "voice": v["id"], "max_audio_length_ms": 160})
        assert r.status_code == 200, r.text
        workers.add(r.headers["x-csmserve-worker"])
        if len(workers) == 2:
            break
    assert workers == {"0", "1"}
    # metrics: every worker reports every request
    time.sleep(0.6)
    n = metric(server, "csmserve:time_to_first_audio_seconds_count")
    assert all(metric(server, "csmserve:time_to_first_audio_seconds_count") == n for _ in range(6)) and n >= 2
    # a conversation continues on whichever worker its next connection lands: each turn's prompt holds
    # the turns before it, so the cached prefix it reuses (positions whose prefill the engine skipped)
    # grows turn by turn; with a lost session it would stay the voice's alone
    url = f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream?binary=1&api_key=k"
    seen, reused = set(), []
    for i in range(8):
        with connect(url) as ws:
            seen.add(ws.response.headers["x-csmserve-worker"])
            time.sleep(0.6)  # the engine's counters reach an idle worker with its heartbeat (every 0.25 s)
            before = metric(server, "csmserve:prefix_cache_hit_positions")
            ws.send(json.dumps({"context_id": "conv", "text": f"Turn number {i}.", "flush": True, "temperature": 0,
                                "max_audio_length_ms": 160, **({"voice": v["id"]} if i == 0 else {})}))
            _, msgs = turn(ws)
            assert msgs[-1]["type"] == "flush_done" and msgs[-1]["num_frames"] > 0
            time.sleep(0.6)
            reused.append(metric(server, "csmserve:prefix_cache_hit_positions") - before)
        if len(seen) == 2 and i >= 2:
            break
    assert seen == {"0", "1"}
    assert all(b > a for a, b in zip(reused[1:], reused[2:])) and reused[1] > 0, reused


def test_the_engine_process_sizes_its_slots_to_its_share_of_the_gpu(monkeypatch):
    """load_engine_model(spec, gpu_share) (a Ray replica's engine process): with a share < 1 and no
    --max-slots, max_slots comes from slots_in_share, in the process holding the weights; serve_engine
    builds the engine from csm.engine_config. (CUDA itself is not exercised here.)"""
    import dataclasses
    from pathlib import Path
    from types import SimpleNamespace

    import csmserve.api
    from csmserve.config import EngineConfig
    from csmserve.server import processes

    class FakeCSM:
        def __init__(self, model, device=None, dtype=None, codec=None, codec_dtype=None, engine_config=None):
            self.device, self.engine_config = SimpleNamespace(type="cuda"), engine_config

    shares = []
    monkeypatch.setattr(csmserve.api, "CSM", FakeCSM)
    monkeypatch.setattr(processes, "slots_in_share", lambda csm, engine, share: shares.append(share) or 7)
    spec = processes.engine_spec("dummy", "cuda", None, None, None, EngineConfig(), "info", Path("/tmp"))
    assert spec.parent_pid == os.getpid() and spec.ring_path != processes.engine_spec(
        "dummy", "cuda", None, None, None, EngineConfig(), "info", Path("/tmp")).ring_path
    half = processes.load_engine_model(spec, gpu_share=0.5).engine_config
    assert half.max_slots == 7 and shares == [0.5]
    # the prefix cache fixed, not half of the device's free memory (a neighbour's share: an H100 with two
    # half-GPU replicas ran out of memory when the first engine's cache took it)
    assert half.prefix_cache_bytes == 2 << 30
    whole = processes.load_engine_model(spec).engine_config  # the whole GPU: sized as ever
    assert whole.max_slots is None and whole.prefix_cache_bytes is None
    fixed = dataclasses.replace(spec, engine=EngineConfig(max_slots=16, prefix_cache_bytes=1 << 20))
    assert processes.load_engine_model(fixed, gpu_share=0.5).engine_config == fixed.engine and shares == [0.5]
    fixed = dataclasses.replace(spec, engine=EngineConfig(max_slots=16))
    assert processes.load_engine_model(fixed, gpu_share=0.5).engine_config.prefix_cache_bytes == 2 << 30


def test_a_half_gpu_share_leaves_room_for_what_is_not_slots(monkeypatch):
    """slots_in_share on the half H100 where two replicas ran out of memory (1ef1ee3): 79.18 GiB, 3.2 GiB of
    weights, a 2 GiB prefix cache, 20.9 MB a slot (KV at max_seq_len 512 + Mimi's state), and the ~6.7 GiB that
    graphs, workspaces and the CUDA context held beside 1,500 slots: slots + all of that fit in the share."""
    from types import SimpleNamespace

    import torch

    from csmserve.config import EngineConfig
    from csmserve.engine import slots
    from csmserve.server import processes

    GiB, slot_bytes, weights, overhead = 1 << 30, 20_900_000, int(3.2 * (1 << 30)), int(6.7 * (1 << 30))
    total = int(79.18 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - weights, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: weights)

    def size_slots(model, mimi, max_seq_len, memory_fraction=0.85, cap=4096, reserve_bytes=0, free_bytes=None):
        return int((free_bytes - reserve_bytes) * memory_fraction) // slot_bytes

    monkeypatch.setattr(slots, "size_slots", size_slots)
    csm = SimpleNamespace(device="cuda", model=None, mimi=None)
    n = processes.slots_in_share(csm, EngineConfig(max_seq_len=512, prefix_cache_bytes=2 * GiB), 0.5)
    assert n * slot_bytes + weights + 2 * GiB + overhead < total // 2, n
    assert 2 * n >= 2048, n  # two half-GPU replicas still hold issue 40's 2,048 users


@contextlib.contextmanager
def engine_process(**engine):
    """An engine-core process on dummy-tiny (EngineConfig: max_slots 2, max_seq_len 256, `engine`), ready: its
    EngineProcess (.spec: the socket's address, the authkey); stopped, the run directory removed, after."""
    import shutil

    from csmserve.config import EngineConfig
    from csmserve.server.processes import EngineProcess, engine_spec, load_engine_model, new_rundir

    rundir = new_rundir()
    spec = engine_spec("dummy-tiny", "cpu", None, None, None,
                       EngineConfig(**{"max_slots": 2, "max_seq_len": 256, **engine}), "warning", rundir)
    proc = EngineProcess(spec, load_engine_model)
    proc.start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(rundir, ignore_errors=True)


@contextlib.contextmanager
def attached_engine(**engine):
    """engine_process(**engine) and a CSM attached to it as an API worker's (client 7), closed after."""
    from csmserve.server.processes import attach_engine

    with engine_process(**engine) as proc:
        csm = attach_engine(proc.spec.address, proc.spec.authkey, 7, timeout=60)
        try:
            yield csm
        finally:
            csm.close()


def test_a_csm_attached_to_an_engine_process_generates_audio():
    """`CSM.attach` (an API worker's CSM, no codec of its own): generate() returns the audio the engine
    process decoded, as an in-process CSM does."""
    with attached_engine() as csm:
        r = csm.generate("Hello there.", temperature=0.0, max_audio_length_ms=240)
        assert r.codes.shape[0] > 0
        assert r.audio is not None and r.audio.shape == (r.codes.shape[0] * 1920,)


def test_a_worker_that_fell_behind_lets_its_requests_go_at_the_engine():
    """A worker busy past --reader-wait-s (its ring rows overwritten) ends its streams with "fell behind" and
    aborts their requests at the engine: an open long-form request (a WebSocket turn, speak() with text still
    coming) would otherwise hold its engine slot for good."""
    with attached_engine(reader_wait_s=0.1) as csm:
        client = csm.client
        read, slept = client._step, []

        def busy_then_read(step, t_recv=0.0):  # the worker busy until the engine reused the buffer
            if step.step >= 0 and len(step.rows) and not slept:
                slept.append(1)
                end = time.time() + 30
                while client.ring["header"][step.ring] == step.step and time.time() < end:
                    time.sleep(0.05)
            read(step, t_recv)

        client._step = busy_then_read
        req = csm.long_request(["Hello there, this is a test."], open=True, temperature=0.0,
                               max_audio_length_ms=None, max_segment_length_ms=60 * 80)
        with pytest.raises(RuntimeError, match="fell behind"):
            for _ in client.stream(req):
                pass
        deadline = time.time() + 20
        while time.time() < deadline and (st := client.stats()).free_slots != st.max_slots:
            time.sleep(0.1)
        st = client.stats()
        assert (st.free_slots, st.running, st.idle) == (st.max_slots, 0, 0), st


def _bad_peer(kind: str, address: str, authkey: bytes) -> list:
    """Connections to the engine's socket that are no worker's: `kind`'s, left open."""
    from multiprocessing.connection import Client

    from csmserve.engine import messages as m

    def raw() -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(address)
        return s

    if kind == "silent":  # connects and sends nothing; another reads the challenge, then answers 3 bytes of 16
        cut = raw()
        cut.recv(256)
        cut.sendall(struct.pack("!i", 16) + b"abc")
        return [raw(), cut]
    if kind == "wrong digest":
        s = raw()
        s.recv(256)
        s.sendall(struct.pack("!i", 16) + os.urandom(16))
        return [s]
    c = Client(address, family="AF_UNIX", authkey=authkey)  # the authkey's, with a Hello that is none
    c.send_bytes(b"not a pickle" if kind == "not a pickle" else pickle.dumps(m.Hello("x"), protocol=5))
    try:
        c.recv_bytes()  # the Welcome (or the engine's close): the engine has read it
    except EOFError:
        pass
    return [c]


@pytest.mark.parametrize("kind", ["silent", "wrong digest", "not a pickle", "client id not an int"])
def test_a_bad_connection_to_the_engine_is_closed_and_the_next_worker_attaches(kind):
    """Whatever a local connection to the engine's socket sends, it alone is closed (a silent one after HELLO_S),
    the engine goes on and the next worker attaches. Before: a silent peer held the accept thread for good, a wrong
    digest (AuthenticationError) or a Hello that is no pickle (UnpicklingError) ended it, so that no worker attached
    again (one restarted waited forever); a Hello("x") killed the engine when it left."""
    from csmserve.server.processes import attach_engine

    with engine_process() as proc:
        bad = _bad_peer(kind, proc.spec.address, proc.spec.authkey)
        for c in bad[:1] if kind == "client id not an int" else ():
            c.close()  # its leaving is what used the id
        got: list = []
        t = threading.Thread(target=lambda: got.append(attach_engine(proc.spec.address, proc.spec.authkey, 8)),
                             daemon=True)
        t.start()
        t.join(10)
        assert got, "no worker attached after the bad connection"
        r = got[0].generate("Hello there.", temperature=0.0, max_audio_length_ms=240)
        assert r.audio is not None and r.audio.size > 0 and proc.alive
        got[0].close()
        from csmserve.engine.core import HELLO_S

        deadline = time.monotonic() + HELLO_S + 5
        for c in bad:
            if isinstance(c, socket.socket):  # closed by the engine: EOF after what it sent
                c.settimeout(max(0.1, deadline - time.monotonic()))
                while c.recv(4096):
                    pass
            c.close()


def test_a_taken_port_is_one_line_naming_it():
    """`csmserve serve` and `serve --ray` (before Ray starts) bind through processes.bind: a port in use is
    an OSError naming it and the flag, not errno text alone."""
    from csmserve.server.processes import bind

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} .*pick another --port"):
            bind("127.0.0.1", port)
    bind("127.0.0.1", port).close()  # free again


def test_max_concurrent_requests_holds_for_the_server_not_each_worker(procs):
    """--max-concurrent-requests 1 over two API workers: while one generation streams on one, a new request is 429
    on the other too (new connections go to the worker with the fewest open: the idle one); once it ends, the next
    is served."""
    server = procs(max_concurrent_requests=1)
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": 30000},
                      timeout=60) as held:
        assert held.status_code == 200
        body = held.iter_raw()  # kept: dropping it closes the connection
        next(body)
        other = {"0": "1", "1": "0"}[held.headers["x-csmserve-worker"]]
        seen: dict[str, int] = {}
        for _ in range(20):
            r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": 160}, timeout=60)
            seen[r.headers["x-csmserve-worker"]] = r.status_code
            if other in seen:
                break
        assert seen.get(other) == 429 and set(seen.values()) == {429}, seen
    for _ in range(50):  # the closed stream's abort reaches its worker's count
        r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "max_audio_length_ms": 160}, timeout=60)
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_cuts_streams_still_open_after_the_shutdown_timeout(tmp_path, workers):
    """SIGTERM: a stream its client stopped reading (held open by a full socket) is cut after --shutdown-timeout-s
    and the server exits then, with one API worker and with the engine on a thread (--api-workers 0)."""
    server = ProcServer(tmp_path, workers=workers, max_seq_len=2048, shutdown_timeout_s=2).start()
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server's writes block: the stream stays open
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps({**SPEECH, "max_audio_length_ms": 150_000}).encode()  # 7.2 MB of pcm
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(1)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        took = time.monotonic() - t0
        assert 1.5 < took < 4.5, took  # held for the timeout, then cut by the worker itself (not at the kill past it)
        sock.close()
    finally:
        server.stop()


def test_a_worker_stopped_mid_message_is_dropped_and_the_engine_goes_on():
    """A worker that sent a message's first bytes and no more (frozen mid-send) is dropped after --reader-wait-s:
    the engine's loop reads a message whole once it began, and held every other worker's streams while it waited."""
    from multiprocessing.connection import Client

    from csmserve.engine import messages as m
    from csmserve.server.processes import attach_engine

    with engine_process(reader_wait_s=0.5) as proc:
        stuck = Client(proc.spec.address, family="AF_UNIX", authkey=proc.spec.authkey)
        stuck.send_bytes(pickle.dumps(m.Hello(9), protocol=5))
        stuck.recv_bytes()  # the Welcome: attached
        raw = socket.socket(fileno=os.dup(stuck.fileno()))
        raw.sendall(struct.pack("!i", 1000) + b"x" * 10)  # 10 bytes of a 1,000-byte message
        csm = attach_engine(proc.spec.address, proc.spec.authkey, 8, timeout=60)
        try:
            got: list = []
            t = threading.Thread(target=lambda: got.append(csm.generate("Hello there.", temperature=0.0,
                                                                        max_audio_length_ms=240)), daemon=True)
            t.start()
            t.join(20)
            assert got and got[0].audio.size > 0, "the engine's loop is held by the worker stopped mid-message"
            raw.settimeout(5)
            assert raw.recv(4096) == b""  # closed by the engine
            assert proc.alive
        finally:
            csm.close()
            raw.close()
            stuck.close()
