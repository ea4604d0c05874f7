"""Faults, against `csmserve serve --api-workers 2` as users run it (a process tree of its own):

- stored voices survive `kill -9` of the whole tree at any moment: uploads and deletes are in flight
  when SIGKILL lands (a random moment, several trials); after each, the SQLite file passes
  `PRAGMA integrity_check`, every voice acknowledged (200) before the kill is there with the same codes,
  every acknowledged delete is gone, and the server restarted on the same --voices-db lists and speaks them
  (and has removed the shared-memory ring and run directory each killed server left behind);
- the engine process killed while a WebSocket turn streams: the turn ends with an `error` message
  (never a hang) and the connection stays usable for answers (the next turn: an error too).
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import sqlite3
import tempfile
import threading
import time

import httpx
import pytest
from websockets.sync.client import connect

from csmserve.apps.bench.serve.server import ServerTree, alive
from server_helpers import ProcServer, wav_bytes

TRIALS = 5
SPEECH = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm",
          "max_audio_length_ms": 160}


def _upload(url: str, name: str, seconds: float) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/voices", timeout=60, data={"name": name, "transcript": "A test tone."},
                      files={"audio_sample": ("v.wav", wav_bytes(seconds, hz=150 + 10 * seconds), "audio/wav")})


def _rows(db: str) -> tuple[str, dict[str, tuple[int, bytes]]]:
    """(PRAGMA integrity_check, {id: (num_frames, codes)}) of the file, read as a restart would."""
    with sqlite3.connect(db) as conn:
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
        rows = {vid: (n, codes) for vid, n, codes in conn.execute("SELECT id, num_frames, codes FROM voices")}
    conn.close()
    return check, rows


def _kill_tree(server: ProcServer) -> None:
    """SIGKILL to the whole process group, then wait until no process of it runs."""
    tree = ServerTree(server.proc.pid)
    pids = list(tree.start())
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.time() + 10
    while any(alive(p) for p in pids):
        assert time.time() < deadline, [p for p in pids if alive(p)]
        time.sleep(0.02)
    server.log.close()


class Ledger:
    """What the clients were told: voices acknowledged created (id -> num_frames) and deleted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.created: dict[str, int] = {}
        self.deleted: set[str] = set()
        self.deleting: set[str] = set()  # sent, no answer (either outcome is right)

    def uploader(self, url: str, stop: threading.Event, rng: random.Random, tag: str) -> None:
        k = 0
        while not stop.is_set():
            try:
                r = _upload(url, f"{tag}-{k}", rng.choice((0.5, 1.0, 3.0, 8.0)))
            except httpx.HTTPError:
                return  # the kill
            k += 1
            if r.status_code == 200:
                with self.lock:
                    self.created[r.json()["id"]] = r.json()["num_frames"]

    def deleter(self, url: str, stop: threading.Event, rng: random.Random, keep: set[str]) -> None:
        while not stop.is_set():
            with self.lock:
                pool = sorted(set(self.created) - keep - self.deleted - self.deleting)
                if len(pool) <= 2:  # leave survivors: the restarts must also show uploads made during the trials
                    vid = None
                else:
                    vid = rng.choice(pool)
                    self.deleting.add(vid)
            if vid is None:
                time.sleep(0.02)
                continue
            try:
                r = httpx.delete(f"{url}/v1/audio/voices/{vid}", timeout=60)
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                with self.lock:
                    self.deleted.add(vid)
                    self.deleting.discard(vid)
                    del self.created[vid]


def test_stored_voices_survive_kill_9_of_the_whole_server_at_any_moment(tmp_path):
    rng = random.Random(13)
    db = str(tmp_path / "voices.db")
    flags = dict(voices_db=db, new_session=True)
    ledger = Ledger()
    server = ProcServer(tmp_path, **flags).start()
    for i in range(3):  # kept for the whole test: never deleted
        r = _upload(server.url, f"kept-{i}", 1.0 + i)
        assert r.status_code == 200, r.text
        ledger.created[r.json()["id"]] = r.json()["num_frames"]
    kept = set(ledger.created)
    snapshot = {vid: codes for vid, (_, codes) in _rows(db)[1].items()}  # the codes as first stored: WAL lets a reader in while the server runs
    killed = []
    for trial in range(TRIALS):
        stop = threading.Event()
        threads = [threading.Thread(target=ledger.uploader, args=(server.url, stop, rng, f"t{trial}u{j}"))
                   for j in range(2)]
        threads.append(threading.Thread(target=ledger.deleter, args=(server.url, stop, rng, kept)))
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.05, 1.5))  # a random moment of uploads and deletes in flight
        _kill_tree(server)
        killed.append(server.proc.pid)
        stop.set()
        for t in threads:
            t.join(30)
        with ledger.lock:
            created, deleted, deleting = dict(ledger.created), set(ledger.deleted), set(ledger.deleting)
        check, rows = _rows(db)
        assert check == "ok", (trial, check)
        for vid, n in created.items():
            if vid in deleting:
                continue
            assert vid in rows, (trial, vid, "acknowledged, lost by kill -9")
            assert rows[vid][0] == n and len(rows[vid][1]) == n * 32 * 2, (trial, vid)
            assert rows[vid][1] == snapshot.setdefault(vid, rows[vid][1]), (trial, vid, "codes changed")
        assert not deleted & set(rows), (trial, deleted & set(rows))
        for vid, (n, codes) in rows.items():  # a write cut by the kill is all or nothing
            assert len(codes) == n * 32 * 2, (trial, vid)
        ledger.deleting.clear()
        for vid in deleting:  # cut mid-delete: the file says which way it went
            if vid in rows:
                ledger.created[vid] = rows[vid][0]
            else:
                ledger.created.pop(vid, None)
                ledger.deleted.add(vid)
        server = ProcServer(tmp_path, **flags).start(timeout=60)  # the same --voices-db; a restart that hangs fails
    try:
        assert len(ledger.created) > len(kept) and ledger.deleted, (len(ledger.created), len(ledger.deleted))
        listed = {v["id"] for v in httpx.get(f"{server.url}/v1/audio/voices", timeout=30).json()["data"]}
        assert set(ledger.created) <= listed and not ledger.deleted & listed
        for vid in sorted(kept) + sorted(set(ledger.created) - kept)[:3]:
            r = httpx.post(f"{server.url}/v1/audio/speech", json={**SPEECH, "voice": vid}, timeout=60)
            assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2, (vid, r.status_code)
        gone = sorted(ledger.deleted)[0]
        assert httpx.get(f"{server.url}/v1/audio/voices/{gone}", timeout=30).status_code == 404
        left = [p for pid in killed for d in ("/dev/shm", tempfile.gettempdir())
                for p in glob.glob(f"{d}/csmserve-{pid}-*")]
        assert not left, left  # swept at the next start
    finally:
        server.stop()


@pytest.fixture
def proc_server(tmp_path):
    server = ProcServer(tmp_path).start()
    yield server
    server.stop()


def test_killing_the_engine_ends_a_websocket_turn_in_flight_with_an_error(proc_server):
    server = proc_server
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream?binary=1", max_size=None) as ws:
        ws.send(json.dumps({"context_id": "c", "text": "A long turn that is still speaking when the engine dies.",
                            "flush": True, "max_audio_length_ms": 20_000}))
        assert isinstance(ws.recv(timeout=30), bytes)  # audio is streaming
        os.kill(server.pids()["engine"], signal.SIGKILL)
        t = time.time()
        while isinstance(m := ws.recv(timeout=10), bytes):  # what was in flight, then the end
            assert time.time() - t < 10
        reply = json.loads(m)
        assert reply["type"] == "error" and reply["context_id"] == "c", reply
        assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
        assert reply["error"]["code"] in ("generation_failed", "engine_failed") and "engine" in reply["error"]["message"]
        assert time.time() - t < 5
        # the connection answers the next turn at once, with the same error, rather than hanging
        ws.send(json.dumps({"context_id": "c", "text": "Again.", "flush": True}))
        reply = json.loads(ws.recv(timeout=10))
        assert reply["type"] == "error" and reply["error"]["code"] == "engine_failed", reply
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
