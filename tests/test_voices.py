import threading

import numpy as np
import pytest

from csmserve.voices import ALIASES, OPENAI_VOICES, VoiceNotFoundError, VoiceStore


def codes(t: int = 25, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, (t, 32))  # [T, 32]


@pytest.fixture
def store(tmp_path):
    with VoiceStore(tmp_path / "voices.db") as s:
        yield s


def test_crud(store):
    v = store.create("me", "Hello there.", codes(), speaker=1)
    assert v.id.startswith("voice_") and v.num_frames == 25 and v.duration_s == pytest.approx(2.0)
    got = store.get(v.id)
    assert (got.name, got.transcript, got.speaker) == ("me", "Hello there.", 1)
    assert got.codes.dtype == np.int64 and np.array_equal(got.codes, codes())
    assert [i.id for i in store.list()] == [v.id]
    assert store.delete(v.id) and not store.delete(v.id)
    assert store.get(v.id) is None and store.list() == []


def test_codes_stored_as_int16(store):
    v = store.create("me", "x", codes(10))
    blob = store._conn.execute("SELECT codes FROM voices WHERE id = ?", (v.id,)).fetchone()[0]
    assert len(blob) == 10 * 32 * 2


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


def test_survives_reopen(tmp_path):
    path = tmp_path / "sub" / "voices.db"
    with VoiceStore(path) as s:
        v = s.create("keep", "Kept.", codes(40))
    with VoiceStore(path) as s:
        assert np.array_equal(s.get("keep").codes, codes(40)) and s.get(v.id).transcript == "Kept."


def test_concurrent_writes(tmp_path):
    path = tmp_path / "voices.db"
    shared, other = VoiceStore(path), VoiceStore(path)  # one store across threads + a second connection

    def work(store: VoiceStore, k: int) -> None:
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
