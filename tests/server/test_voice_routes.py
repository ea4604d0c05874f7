"""Voices: create, list, use, delete; stored voices survive a restart and condition the prompt. Each test
runs on both voice-store backends: an SQLite file and a PostgreSQL database (tests/pg.py)."""
import httpx
import numpy as np
import openai
import pytest

from server_helpers import SHORT_MS, error_of, wav_bytes


def create(url: str, name: str = "narrator", transcript: str = "A short reference clip.", seconds: float = 1.0,
           **data) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/voices", timeout=60, data={"name": name, "transcript": transcript, **data},
                      files={"audio_sample": ("ref.wav", wav_bytes(seconds), "audio/wav")})


def audio_rows(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    # prompt frames carrying audio codes (context clips and their EOS frames) -> their codes [n, 32]
    return tokens[mask[:, :32].any(axis=1), :32]


@pytest.fixture(params=["sqlite", "postgres"])
def voices_db(request, tmp_path) -> str:
    return request.getfixturevalue("pg_url") if request.param == "postgres" else str(tmp_path / "persist.db")


@pytest.fixture
def server(serve, voices_db):
    return serve(voices_db=voices_db)


def test_create_list_get_delete(server):
    r = create(server.url, speaker="1")
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["id"].startswith("voice_") and v["object"] == "audio.voice" and v["name"] == "narrator"
    assert v["speaker"] == 1 and v["num_frames"] in (12, 13)  # 1 s = 12.5 frames of 80 ms
    listed = httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]
    assert {"id": v["id"], "name": "narrator"}.items() <= listed[0].items()
    assert {"alloy", "nova"} <= {x["id"] for x in listed}  # OpenAI names as aliases
    assert all("adapter" in x for x in listed)  # every voice object has the key (docs/api.md), aliases' null
    assert httpx.get(f"{server.url}/v1/audio/voices/{v['id']}").json()["transcript"] == "A short reference clip."
    assert httpx.delete(f"{server.url}/v1/audio/voices/{v['id']}").json() == {
        "id": v["id"], "object": "audio.voice", "deleted": True}
    assert error_of(httpx.delete(f"{server.url}/v1/audio/voices/{v['id']}"))["code"] == "voice_not_found"
    assert v["id"] not in {x["id"] for x in httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]}


def test_past_max_voices_a_create_is_409_until_one_is_deleted(serve, voices_db):
    """--max-voices: the create past it is refused in OpenAI's shape and stores nothing; the voices stored stay
    listed and usable; a delete makes room for one more."""
    server = serve(voices_db=voices_db, max_voices=2)
    a, b = (create(server.url, name=n).json()["id"] for n in ("a", "b"))
    for name in ("c", "a"):  # a name taken is no overwrite (names repeat): a voice more all the same
        r = create(server.url, name=name)
        assert r.status_code == 409, r.text
        assert set(r.json()) == {"error"} and error_of(r) == {
            "message": "2 voices are stored, the most this server keeps; delete one first (--max-voices)",
            "type": "invalid_request_error", "param": None, "code": "too_many_voices"}

    def stored() -> list[str]:
        voices = httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]
        return [v["id"] for v in voices if v["type"] == "audio_sample"]

    assert stored() == [a, b] and httpx.get(f"{server.url}/v1/audio/voices/a").json()["id"] == a
    assert httpx.delete(f"{server.url}/v1/audio/voices/{a}").status_code == 200
    c = create(server.url, name="c")
    assert c.status_code == 200, c.text
    assert stored() == [b, c.json()["id"]]
    assert create(server.url, name="d").status_code == 409
    assert httpx.get(f"{server.url}/v1/audio/voices/{b}").json()["name"] == "b"


def test_a_voices_db_past_its_timeout_is_503(serve, pg_url):
    """--voices-db-timeout-s: a PostgreSQL voices DB that does not answer in time (its table locked) gets the
    routes that read it a 503 in OpenAI's shape (it was a 500 after the server's own timeouts, if any, or a hang),
    and the server answers as before once the database does."""
    import psycopg

    server = serve(voices_db=pg_url, voices_db_timeout_s=0.5)
    v = create(server.url, name="kept").json()
    with psycopg.connect(pg_url) as blocker:
        blocker.execute("LOCK TABLE csmserve_voices IN ACCESS EXCLUSIVE MODE")
        for r in (httpx.get(f"{server.url}/v1/audio/voices", timeout=10),
                  httpx.get(f"{server.url}/v1/audio/voices/{v['id']}", timeout=10),
                  create(server.url, name="more"),
                  httpx.post(f"{server.url}/v1/audio/speech", timeout=10, json={
                      "model": "tts-1", "voice": "kept", "input": "Hi.", "response_format": "pcm"})):
            assert r.status_code == 503, r.text
            assert set(r.json()) == {"error"} and error_of(r)["code"] == "voices_db_unavailable"
            assert error_of(r)["type"] == "server_error" and "--voices-db-timeout-s" in error_of(r)["message"]
        blocker.rollback()
    assert httpx.get(f"{server.url}/v1/audio/voices/{v['id']}").json()["name"] == "kept"


def test_voice_survives_restart_and_conditions_the_prompt(serve, csm, voices_db):
    db = voices_db
    first = serve(voices_db=db)
    v = create(first.url, name="keeper", transcript="Keep this voice.").json()
    stored = first.state.store.get(v["id"]).codes
    first.stop()

    second = serve(voices_db=db)  # a new app over the same SQLite file / database
    assert v["id"] in {x["id"] for x in httpx.get(f"{second.url}/v1/audio/voices").json()["voices"]}
    c = openai.OpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0)
    cache = csm.client.engine.prefix_cache
    hits = cache.stats["hits"]
    for voice in (v["id"], {"id": v["id"]}, "keeper"):  # by id, as an object, by name
        second.state.last_prompt = None
        with c.audio.speech.with_streaming_response.create(
                model="tts-1", voice=voice, input="Now say this.", response_format="pcm",
                extra_body={"max_audio_length_ms": SHORT_MS, "seed": 1}) as r:
            assert r.status_code == 200 and len(r.read()) > 0
        tokens, mask = second.state.last_prompt
        rows = audio_rows(tokens, mask)
        np.testing.assert_array_equal(rows[:-1], stored)  # the clip's codes, then the turn's EOS frame
        assert not rows[-1].any()
        want = csm.prompt("Now say this.", speaker=0, context=[_segment(v, stored)], max_audio_length_ms=SHORT_MS)
        np.testing.assert_array_equal(tokens, want[0])
        np.testing.assert_array_equal(mask, want[1])
    assert cache.stats["hits"] >= hits + 2  # the voice's reference turn is prefilled once, then copied

    # an alias carries no clip: no audio frames in the prompt
    with c.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Plain.",
                                                       extra_body={"max_audio_length_ms": SHORT_MS}) as r:
        r.read()
    assert audio_rows(*second.state.last_prompt).size == 0


@pytest.mark.inproc
def test_a_stored_voice_named_like_a_preset_takes_it_over(server, monkeypatch):
    """`alloy` is a preset (no clip) until a voice named `alloy` is stored: through this worker at once, through
    another worker (the store written directly) once ALIAS_RECHECK_S has passed; deleted, the preset again. In
    between, the preset's requests read no store."""
    from csmserve.server import state as state_mod

    def rows() -> int:
        server.state.last_prompt = None
        r = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={
            "model": "tts-1", "voice": "alloy", "input": "Say this.", "response_format": "pcm",
            "max_audio_length_ms": 160})
        assert r.status_code == 200, r.text
        return audio_rows(*server.state.last_prompt).shape[0]

    monkeypatch.setattr(state_mod, "ALIAS_RECHECK_S", 60.0)
    store, reads = server.state.store, []
    resolve = store.resolve
    monkeypatch.setattr(store, "resolve", lambda key: reads.append(key) or resolve(key))
    assert rows() == 0 and rows() == 0 and reads == ["alloy"]  # looked up once, then not again
    v = create(server.url, name="alloy").json()
    assert rows() == store.get(v["id"]).num_frames + 1  # at once: its clip and the turn's EOS frame
    assert httpx.delete(f"{server.url}/v1/audio/voices/{v['id']}").status_code == 200
    assert rows() == 0
    other = store.create("alloy", "Made through another worker.", np.ones((5, 32), np.int64), 0)
    try:
        server.state._not_stored["alloy"] -= 60.0  # ALIAS_RECHECK_S later
        assert rows() == 5 + 1
    finally:
        store.delete(other.id)


def _segment(v, codes):
    from csmserve.api import Segment

    return Segment(v["speaker"], v["transcript"], codes=codes)


@pytest.mark.inproc
def test_context_turn_by_voice_id(server):
    v = create(server.url).json()
    r = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, json={
        "model": "tts-1", "voice": "alloy", "input": "Reply.", "response_format": "pcm", "max_audio_length_ms": 160,
        "context": [{"speaker": 1, "voice_id": v["id"]}]})
    assert r.status_code == 200
    rows = audio_rows(*server.state.last_prompt)
    np.testing.assert_array_equal(rows[:-1], server.state.store.get(v["id"]).codes)
