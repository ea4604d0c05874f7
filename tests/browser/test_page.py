"""The web page at `/` in a real browser: Debian's headless Chromium driven by Playwright (no browser
download). Creates a voice from a WAV file, speaks two typed turns and one recorded turn (Chromium's
fake microphone) as a conversation, and checks that PCM arrived and Web Audio played it.

Skipped where Chromium or Playwright is missing, failed under CI=true (tests/browser/chromium.py).
The screenshot of the filled page goes to artifacts/browser/page.png.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "browser"
sys.path.insert(0, str(ROOT / "tests" / "server"))
from server_helpers import Server, wav_bytes  # noqa: E402
from chromium import ARGS, CHROMIUM  # noqa: E402


@contextmanager
def dummy_server(tmp_path_factory, adapters: dict[str, str] | None = None, **config):
    """The pages' server: dummy-tiny on the CPU (chunks of 1, then 2 frames), its voices in a fresh SQLite file;
    adapters: CSM's; config: ServerConfig's. Stopped on exit."""
    from csmserve import CSM
    from csmserve.config import EngineConfig, ServerConfig
    from csmserve.server import create_app

    csm = CSM("dummy-tiny", device="cpu", dtype="float32", adapters=adapters,
              engine_config=EngineConfig(max_slots=4, max_seq_len=1024, first_chunk_frames=1, chunk_frames=2))
    db = tmp_path_factory.mktemp("voices") / "voices.db"
    s = Server(create_app(csm, ServerConfig(voices_db=str(db), model_name="dummy-tiny", **config))).start()
    try:
        yield s
    finally:
        s.stop()
        csm.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with dummy_server(tmp_path_factory, default_audio_length_ms=800) as s:
        yield s


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright  # here: conftest.py skips (or fails in CI) without it

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=ARGS,
            viewport={"width": 1280, "height": 900}, permissions=["microphone"])
        page = context.pages[0] if context.pages else context.new_page()
        page.problems = []  # console errors and uncaught exceptions
        page.on("console", lambda m: m.type == "error" and page.problems.append(m.text))
        page.on("pageerror", lambda e: page.problems.append(str(e)))
        page.set_default_timeout(60_000)
        yield page
        context.close()


def counters(page) -> dict:
    return page.evaluate("""() => ({samples: csm.samplesReceived, chunks: csm.chunksReceived, t: csm.playbackTime(),
        played: csm.playedSeconds, ttfa: csm.ttfaMs, rtf: csm.rtf, utterances: csm.utterances, errors: csm.errors,
        turns: csm.turns.length, state: csm.audioContext && csm.audioContext.state})""")


def test_page_voice_speak_conversation(server, page, tmp_path):
    clip = tmp_path / "clip.wav"
    clip.write_bytes(wav_bytes(1.0))
    page.goto(server.url + "/")
    assert page.title().startswith("csmserve")
    page.wait_for_function("document.querySelectorAll('#voice-select option').length > 0")
    assert "dummy-tiny" in page.inner_text("#model")

    # a voice from a WAV file
    page.set_input_files("#voice-file", str(clip))
    page.fill("#voice-name", "tone")
    page.fill("#voice-transcript", "A steady tone for one second.")
    page.click("#voice-create-btn")
    page.wait_for_function("window.csm.createdVoice !== undefined")
    assert "created" in page.inner_text("#voice-status")
    voice_id = page.evaluate("csm.createdVoice.id")
    assert page.input_value("#voice-select") == voice_id
    assert [v.name for v in server.state.store.list()] == ["tone"]

    # keep turns short on the CPU: at most 8 frames per sentence (long-form speaks sentence by sentence)
    page.fill("#max-ms", "640")
    page.fill("#seed", "1")
    page.fill("#text", "Hello from the browser. This is the first turn.")
    page.click("#speak")
    page.wait_for_function("csm.samplesReceived > 0")
    first = counters(page)
    page.wait_for_function("csm.utterances >= 1 && !csm.busy")
    page.wait_for_function(f"csm.playbackTime() > {first['t']} + 0.3 && csm.playedSeconds > 0")
    after = counters(page)
    assert after["samples"] == 2 * 8 * 1920, after  # two sentences, 8 frames each (dummy-tiny never ends early)
    assert after["t"] > first["t"] and after["ttfa"] > 0 and after["rtf"] > 0, after
    assert after["state"] == "running", after

    # a recorded turn of "yours" (the fake microphone), then a typed turn: context for each other
    page.click("#turn-record")
    page.wait_for_timeout(700)
    page.click("#turn-record")
    page.wait_for_function("!document.querySelector('#turn-add').disabled")
    page.fill("#turn-transcript", "And this is me answering.")
    page.click("#turn-add")
    page.fill("#text", "A second turn, after hearing both.")
    page.click("#speak")
    page.wait_for_function("csm.utterances >= 2 && !csm.busy")
    done = counters(page)
    assert done["samples"] == (2 + 1) * 8 * 1920 and done["turns"] == 3 and not done["errors"], done
    assert page.locator("#turns li.turn").count() == 3
    assert page.locator("#turns li.turn.you").count() == 1
    assert "TTFA" in page.inner_text("#turns li.turn.csm >> nth=1")
    assert "ms" in page.inner_text("#stat-ttfa") and "real time" in page.inner_text("#stat-rtf")

    # a third typed turn in the same WebSocket context: the server carried the earlier turns
    page.fill("#text", "Still me.")
    page.click("#speak")
    page.wait_for_function("csm.utterances >= 3 && !csm.busy")
    assert counters(page)["samples"] == (2 + 1 + 1) * 8 * 1920

    page.fill("#text", "What should I say next?")  # the filled page, for the screenshot
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not page.problems, page.problems


def test_page_is_served(server):
    import httpx

    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/static/app.js" in r.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"], (name, r.headers)
