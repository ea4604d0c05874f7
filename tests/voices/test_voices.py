import threading
import time

import numpy as np
import pytest

from csmserve.voices import (ALIASES, OPENAI_VOICES, VoiceBackend, VoiceLimitError, VoiceNotFoundError, VoiceStore,
                             VoiceStoreError, open_voice_store)


def codes(t: int = 25, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, (t, 32))  # [T, 32]


@pytest.fixture(params=["sqlite", "postgres"])
def where(request, tmp_path) -> str:
    """Where a store lives: an SQLite file, or a fresh database on the test PostgreSQL server."""
    if request.param == "postgres":
        return request.getfixturevalue("pg_url")
    return str(tmp_path / "sub" / "voices.db")


@pytest.fixture
def store(where):
    with open_voice_store(where) as s:
        yield s


def test_open_picks_the_backend(where):
    with open_voice_store(where) as s:
        assert isinstance(s, VoiceBackend)
        assert type(s).__name__ == ("PostgresVoiceStore" if where.startswith("postgresql://") else "VoiceStore")


def test_postgres_url_shown_without_password():
    pytest.importorskip("psycopg")
    from csmserve.voices.postgres import display_url

    assert display_url("postgresql://csm:s3cret@db.internal:5433/voices") == "postgresql://csm@db.internal:5433/voices"


def test_postgres_connect_params_let_the_url_win(monkeypatch):
    """The connect timeout (and TCP keepalives, tcp_user_timeout) default to --voices-db-timeout-s only where the
    URL names none (a keyword would override the URL's); the statement timeout is SET unless the URL's options
    (or PGOPTIONS) set one."""
    pytest.importorskip("psycopg")
    from csmserve.voices.postgres import connect_params

    monkeypatch.delenv("PGOPTIONS", raising=False)
    kw, ms = connect_params("postgresql://csm@db/voices", 2.5)
    assert kw == {"autocommit": True, "connect_timeout": 3, "keepalives": 1, "keepalives_idle": 3,
                  "keepalives_interval": 1, "keepalives_count": 3, "tcp_user_timeout": 2500} and ms == 2500
    assert connect_params("postgresql://db/v", 0.2)[0]["connect_timeout"] == 2  # libpq takes 1 as 2
    kw, ms = connect_params("postgresql://csm@db/voices?connect_timeout=30&keepalives_idle=60", 10.0)
    assert "connect_timeout" not in kw and "keepalives_idle" not in kw and kw["keepalives_count"] == 3
    assert ms == 10_000
    assert connect_params("host=db dbname=v connect_timeout=5", 10.0)[0].get("connect_timeout") is None
    assert connect_params("postgresql://db/v?options=-c%20statement_timeout%3D99", 10.0)[1] is None
    monkeypatch.setenv("PGOPTIONS", "-c statement_timeout=5s")
    assert connect_params("postgresql://db/v", 10.0)[1] is None


def test_a_postgres_statement_past_the_timeout_raises_promptly(pg_url):
    """--voices-db-timeout-s: a statement the server does not finish in time (here: the table locked by another
    connection) ends after the timeout with VoiceStoreError (the routes' 503), and the store works on after it."""
    import psycopg

    with open_voice_store(pg_url, timeout_s=0.5) as s, psycopg.connect(pg_url) as blocker:
        v = s.create("kept", "t", codes())
        blocker.execute("LOCK TABLE csmserve_voices IN ACCESS EXCLUSIVE MODE")  # held to blocker's commit
        for call in (lambda: s.get(v.id), s.list, lambda: s.create("more", "t", codes(), max_voices=9)):
            t0 = time.monotonic()
            with pytest.raises(VoiceStoreError, match=r"did not answer within 0.5 s \(--voices-db-timeout-s\)"):
                call()
            assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(VoiceStoreError):  # a plain statement too, whatever it waits on
            s._run(lambda c: c.execute("SELECT pg_sleep(30)"))
        assert time.monotonic() - t0 < 3
        blocker.rollback()
        assert s.get(v.id).name == "kept" and [i.id for i in s.list()] == [v.id]


def test_crud(store):
    v = store.create("me", "Hello there.", codes(), speaker=1)
    assert v.id.startswith("voice_") and v.num_frames == 25 and v.duration_s == pytest.approx(2.0)
    got = store.get(v.id)
    assert (got.name, got.transcript, got.speaker) == ("me", "Hello there.", 1)
    assert got.codes.dtype == np.int64 and np.array_equal(got.codes, codes())
    assert [i.id for i in store.list()] == [v.id]
    assert store.delete(v.id) and not store.delete(v.id)
    assert store.get(v.id) is None and store.list() == []


def test_codes_stored_as_int16(tmp_path):
    store = VoiceStore(tmp_path / "voices.db")
    v = store.create("me", "x", codes(10))
    blob = store._conn.execute("SELECT codes FROM voices WHERE id = ?", (v.id,)).fetchone()[0]
    assert len(blob) == 10 * 32 * 2


def test_a_new_file_s_wal_switch_found_locked_is_tried_again(tmp_path):
    """Processes opening a new voices file at once: the one switching it to WAL makes the others' switch fail
    with "database is locked" (the busy timeout does not cover it): they try again until the wait is over."""
    import sqlite3

    store = VoiceStore(tmp_path / "voices.db")
    real, calls = store._conn, []

    class Locked:  # the first two tries find it locked
        def execute(self, sql, *a):
            calls.append(sql)
            if len(calls) <= 2:
                raise sqlite3.OperationalError("database is locked")
            return real.execute(sql, *a)

    store._conn = Locked()
    store._wal()
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store._wal(wait_s=0.0)  # past the wait: the error
    store._conn = real


def test_names_repeat_ids_do_not(store):
    a = store.create("same", "one", codes(seed=1))
    b = store.create("same", "two", codes(seed=2))
    assert a.id != b.id
    assert store.get("same").id == b.id  # the newest with that name
    assert store.get(a.id).transcript == "one"  # ids first


def test_rejects_bad_input(store):
    for bad in (np.zeros((5, 8), int), np.zeros((0, 32), int), np.full((2, 32), 2048), np.zeros((2, 32), np.float32)):
        with pytest.raises(ValueError):
            store.create("x", "t", bad)
    with pytest.raises(ValueError):
        store.create(" ", "t", codes())


def test_survives_reopen(where):
    with open_voice_store(where) as s:
        v = s.create("keep", "Kept.", codes(40))
    with open_voice_store(where) as s:
        assert np.array_equal(s.get("keep").codes, codes(40)) and s.get(v.id).transcript == "Kept."


def test_concurrent_writes(where):
    shared, other = open_voice_store(where), open_voice_store(where)  # one store across threads + a second one

    def work(store: VoiceBackend, k: int) -> None:
        for i in range(20):
            v = store.create(f"t{k}-{i}", "text", codes(5, seed=k))
            assert store.get(v.id) is not None

    threads = [threading.Thread(target=work, args=(shared if k % 2 else other, k)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(shared.list()) == 160 and len({v.id for v in other.list()}) == 160
    shared.close(), other.close()


def test_max_voices_holds_under_racing_creates(where):
    """Creates with max_voices from 8 stores at once (8 API workers, or replicas on one PostgreSQL), each on a
    thread: exactly max_voices are stored, every other create is refused and writes nothing."""
    stores = [open_voice_store(where) for _ in range(8)]
    shared, other = stores[:2]
    made, refused, start = [], [], threading.Barrier(8)

    def work(store: VoiceBackend, k: int) -> None:
        start.wait()
        for i in range(5):
            try:
                made.append(store.create(f"t{k}-{i}", "text", codes(5, seed=k), max_voices=7).id)
            except VoiceLimitError as e:
                refused.append(str(e))

    threads = [threading.Thread(target=work, args=(stores[k], k)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 7 and len(refused) == 33 and sorted(v.id for v in other.list()) == sorted(made)
    assert refused[0] == "7 voices are stored, the most this server keeps; delete one first"
    assert shared.delete(made[0]) and shared.create("again", "t", codes(), max_voices=7).name == "again"
    with pytest.raises(VoiceLimitError):
        other.create("more", "t", codes(), max_voices=7)
    assert other.create("uncapped", "t", codes()).name == "uncapped"  # None: no cap (the store's own callers)
    for s in stores:
        s.close()


def test_resolve_aliases_and_stored(store):
    assert set(ALIASES) == set(OPENAI_VOICES) and len(OPENAI_VOICES) == 13
    r = store.resolve("alloy")
    assert r.voice is None and r.speaker == ALIASES["alloy"]
    assert store.resolve("Echo").speaker == ALIASES["echo"]
    v = store.create("mine", "Hi.", codes(), speaker=1)
    assert store.resolve(v.id).voice.id == v.id
    assert store.resolve({"id": v.id}).speaker == 1
    assert store.resolve("mine").voice.id == v.id
    shadow = store.create("alloy", "Mine now.", codes())  # a stored name takes over the alias
    assert store.resolve("alloy").voice.id == shadow.id
    for bad in ("nobody", {"id": "voice_missing"}, {"name": "x"}, ""):
        with pytest.raises(VoiceNotFoundError):
            store.resolve(bad)


def test_in_memory_store():
    with VoiceStore(":memory:") as s:
        s.create("a", "b", codes())
        assert len(s.list()) == 1


def test_created_in_one_store_seen_by_another_at_once(where):
    """Two stores over one database (two replicas): a voice one creates, the other resolves at once;
    once deleted, neither has it."""
    with open_voice_store(where) as a, open_voice_store(where) as b:
        v = a.create("shared", "Shared.", codes(8))
        assert b.resolve(v.id).voice.id == v.id and b.get("shared").id == v.id
        assert b.delete(v.id)
        assert a.get(v.id) is None and a.list() == [] and not a.delete(v.id)


def test_a_voice_bound_to_an_adapter(store):
    v = store.create("annie", "Hi.", codes(), speaker=1, adapter="ann")
    plain = store.create("plain", "Hi.", codes())
    assert v.adapter == "ann" and plain.adapter is None
    assert store.get("annie").adapter == "ann" and store.get(plain.id).adapter is None
    assert store.resolve("annie").voice.adapter == "ann"
    assert {i.name: i.adapter for i in store.list()} == {"annie": "ann", "plain": None}
    assert store.create("empty", "Hi.", codes(), adapter="").adapter is None


_OLD_SQLITE = """CREATE TABLE voices (id TEXT PRIMARY KEY, name TEXT NOT NULL, transcript TEXT NOT NULL,
    speaker INTEGER NOT NULL, sample_rate INTEGER NOT NULL, num_frames INTEGER NOT NULL, codes BLOB NOT NULL,
    created_at REAL NOT NULL);"""
_OLD_PG = """CREATE TABLE csmserve_voices (seq BIGSERIAL, id TEXT PRIMARY KEY, name TEXT NOT NULL,
    transcript TEXT NOT NULL, speaker INTEGER NOT NULL, sample_rate INTEGER NOT NULL, num_frames INTEGER NOT NULL,
    codes BYTEA NOT NULL, created_at DOUBLE PRECISION NOT NULL)"""


def test_a_database_from_before_adapters_is_migrated(where):
    """A voices table without the adapter column (made before it existed) gets it when a store opens it: the old
    voices stay and speak with the base (NULL), new ones may be bound."""
    blob = codes(3).astype("<i2").tobytes()
    row = ("voice_old", "old", "Old.", 0, 24000, 3, blob, 1.0)
    if where.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(where, autocommit=True) as c:
            c.execute("DROP TABLE IF EXISTS csmserve_voices")
            c.execute(_OLD_PG)
            c.execute("INSERT INTO csmserve_voices (id, name, transcript, speaker, sample_rate, num_frames, codes, "
                      "created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", row)
    else:
        import sqlite3
        from pathlib import Path

        Path(where).parent.mkdir(parents=True, exist_ok=True)
        with sqlite3.connect(where) as c:
            c.executescript(_OLD_SQLITE)
            c.execute("INSERT INTO voices (id, name, transcript, speaker, sample_rate, num_frames, codes, created_at) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
    for _ in range(2):  # opened again: migrated once
        with open_voice_store(where) as s:
            old = s.get("old")
            assert old.adapter is None and old.transcript == "Old." and np.array_equal(old.codes, codes(3))
            s.create("new", "New.", codes(), adapter="ann")
            assert s.get("new").adapter == "ann"
