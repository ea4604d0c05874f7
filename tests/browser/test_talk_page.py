"""The page's Talk mode in headless Chromium: a WAV file fed as the microphone, local OpenAI-compatible
stand-ins (with CORS) for the transcription and chat endpoints, CSM on dummy-tiny (tests/test_talk.py
has the stand-ins and the CLI's tests)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
sys.path.insert(0, str(ROOT))
from server_helpers import Server, free_port, wav_bytes  # noqa: E402
from tests.apps.test_talk import REPLY, TRANSCRIPTS, StandIns  # noqa: E402
from chromium import ARGS, CHROMIUM  # noqa: E402
from test_page import dummy_server  # noqa: E402


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from fastapi.middleware.cors import CORSMiddleware

    with dummy_server(tmp_path_factory) as s:
        stand = StandIns()
        stand.app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
        e = Server(stand.app).start()
        yield s, e, stand
        e.stop()


def speak_turn(page, n_before: int, seconds: float = 0.6) -> None:
    page.click("#talk-rec")
    page.wait_for_function("document.querySelector('#talk-rec').classList.contains('rec')")
    time.sleep(seconds)
    page.click("#talk-rec")
    page.wait_for_function(f"csm.talk.turns.length > {n_before}")


def test_talk_mode_three_turns_barge_in_and_errors(servers, tmp_path):
    server, endpoints, stand = servers
    mic = tmp_path / "mic.wav"
    mic.write_bytes(wav_bytes(2.0))
    from playwright.sync_api import sync_playwright  # here: conftest.py skips (or fails in CI) without it

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=ARGS + [f"--use-file-for-fake-audio-capture={mic}"], permissions=["microphone"])
        page = context.pages[0] if context.pages else context.new_page()
        problems = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.set_default_timeout(60_000)
        try:
            page.goto(server.url + "/")
            page.wait_for_function("document.querySelectorAll('#voice-select option').length > 0")
            page.fill("#talk-asr", endpoints.url + "/v1")
            page.fill("#talk-llm", endpoints.url)
            page.fill("#max-ms", "320")
            page.fill("#temperature", "0")

            speak_turn(page, 0)  # turn 1: to the end
            page.wait_for_function("csm.talk.turns[0].finish && !csm.talk.busy()")
            speak_turn(page, 1)  # turn 2: interrupted while it plays
            page.wait_for_function("csm.talk.turns[1].firstAudioAt")
            time.sleep(0.4)
            speak_turn(page, 2)  # turn 3: barges in
            page.wait_for_function("csm.talk.turns[2].finish && !csm.talk.busy()")
            turns = page.evaluate("csm.talk.turns")
            latency = page.inner_text("#talk-latency")
            # the LLM unreachable: a clear message; back: the conversation goes on
            page.fill("#talk-llm", f"http://127.0.0.1:{free_port()}/v1")
            speak_turn(page, 3)
            page.wait_for_function("csm.talk.errors.length > 0")
            error = page.inner_text("#talk-status")
            page.fill("#talk-llm", endpoints.url)
            speak_turn(page, 4)
            page.wait_for_function("csm.talk.turns[4].finish && !csm.talk.busy()")
            last = page.evaluate("csm.talk.turns[4]")
            # the server refuses a reply (a voice that is not there): the Talk panel says so, not "replied"
            page.evaluate("""() => { const s = document.querySelector('#voice-select');
                s.add(new Option('gone', 'voice_gone')); s.value = 'voice_gone'; }""")
            speak_turn(page, 5)
            page.wait_for_function("csm.talk.errors.length > 1 && !csm.talk.busy()")
            refused = (page.inner_text("#talk-status"), page.evaluate("csm.talk.turns[5]"))
        finally:
            context.close()
    assert not problems
    assert [t["text"] for t in turns] == TRANSCRIPTS
    assert all(t.get("error") is None for t in turns)
    for t in (turns[0], turns[2]):  # speech started before the chat stream ended
        assert t["firstAudioAt"] < t["lastTokenAt"]
        assert t["asr"] > 0 and t["llm"] > 0 and t["csm"] > 0 and abs(t["total"] - t["asr"] - t["llm"] - t["csm"]) < 1
    assert "transcription" in latency and "LLM first token" in latency and "CSM first audio" in latency
    # barge-in: turn 2's reply was cut at what was played
    cut = turns[1]
    assert cut["interrupted"] and 0 < cut["playedSamples"] <= cut["receivedSamples"] and cut["playedSamples"] % 1920 == 0
    # its text: the sentences whose audio began to play (the server's segment messages), the same in the next
    # reply's context (and the LLM's history)
    assert cut["heard"] and REPLY.startswith(cut["heard"]) and turns[2]["sentContext"][3]["text"] == cut["heard"]
    # each reply's context: both sides' earlier audio, with their speaker ids; the cut reply as played
    assert [c["speaker"] for c in turns[0]["sentContext"]] == [1]
    assert [c["speaker"] for c in turns[1]["sentContext"]] == [1, 0, 1]
    assert [c["speaker"] for c in turns[2]["sentContext"]] == [1, 0, 1, 0, 1]
    assert all(c["audioBytes"] > 44 for t in turns for c in t["sentContext"])
    assert turns[2]["sentContext"][3]["audioBytes"] == 44 + 2 * cut["playedSamples"]
    assert turns[2]["sentContext"][1]["text"] == REPLY
    assert "LLM endpoint" in error and "unreachable" in error and "goes on" in error
    assert last.get("error") is None and last["firstAudioAt"] and len(last["sentContext"]) == 8
    status, rec = refused
    assert "not found" in status and "replied" not in status
    assert rec["finish"] == "error" and "not found" in rec["error"]
