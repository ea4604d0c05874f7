"""`csmserve talk` (csmserve/apps/talk/) against local OpenAI-compatible stand-ins for the chat and transcription
endpoints, CSM in-process on dummy-tiny (CPU)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from csmserve import CSM
from csmserve.config import EngineConfig
from csmserve.apps.common import read_clip, wav_bytes
from csmserve.apps.talk import TalkSession
from tests.server.server_helpers import Server, free_port

REPLY = "Hello there, friend. I am doing well today. Thanks for asking me that!"
TRANSCRIPTS = ["How are you?", "Tell me more.", "What else?"]
TOKEN_DELAY_S = 0.12  # 13 words in 1.56 s: the first audio (0.2-0.45 s in) comes well before the last, loaded or not
SENT_MS = 320  # 4 frames per sentence at most: keeps the CPU test quick


class StandIns:
    """A streaming chat completions endpoint and a transcription endpoint, OpenAI-shaped."""

    def __init__(self) -> None:
        self.chat_requests: list[list[dict]] = []
        self.last_token_t: list[float] = []
        self.asr_calls = 0
        self.fail_llm = False
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            assert body["stream"] is True
            if self.fail_llm:
                return JSONResponse({"error": {"message": "model is loading"}}, status_code=503)
            self.chat_requests.append(body["messages"])

            async def gen():
                words = REPLY.split(" ")
                for i, w in enumerate(words):
                    await asyncio.sleep(TOKEN_DELAY_S)
                    piece = w if i == 0 else " " + w
                    if i == len(words) - 1:
                        self.last_token_t.append(time.perf_counter())
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/v1/audio/transcriptions")
        async def transcriptions(request: Request):
            form = await request.form()
            assert len(await form["file"].read()) > 44 and form["model"]  # a WAV from the CLI, webm from the page
            text = TRANSCRIPTS[self.asr_calls % len(TRANSCRIPTS)]
            self.asr_calls += 1
            return {"text": text}

        self.app = app


@pytest.fixture(scope="module")
def csm():
    c = CSM("dummy-tiny", device="cpu", dtype="float32",
            engine_config=EngineConfig(max_slots=2, max_seq_len=1024, first_chunk_frames=1, chunk_frames=2))
    yield c
    c.close()


def _user_wav(seed: int, seconds: float = 0.5, rate: int = 16_000) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return wav_bytes((0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.01 * rng.standard_normal(t.size))
                     .astype(np.float32), rate)


def _audio_rows(csm, context) -> list[np.ndarray]:
    """The audio frames of the real prompt CSM builds from this context (rows whose 32 code columns are set)."""
    tokens, mask = csm.prompt("x", 0, context)
    rows = tokens[mask[:, :32].all(1), :32]
    return rows[rows.any(1)]  # without the all-zero frame that ends each turn's audio


@pytest.mark.serial  # speech must start before the chat stream ends: real-time overlap (CI: 0.76 s beside a worker)
def test_three_turns_context_streaming_and_barge_in(csm):
    stand = StandIns()
    server = Server(stand.app).start()
    try:
        session = TalkSession(csm, llm_url=server.url + "/v1", llm_model="stand-in", asr_url=server.url,
                              speaker=0, user_speaker=1, temperature=0.0, max_audio_length_ms=SENT_MS, log=lambda s: None)
        wavs = [_user_wav(i) for i in range(3)]
        turns = [session.turn(wavs[0]), session.turn(wavs[1]), session.turn(wavs[2], barge_in_after_ms=3 * 80)]
    finally:
        server.stop()
    assert [t.error for t in turns] == [None, None, None]
    assert [t.user_text for t in turns] == TRANSCRIPTS

    # the LLM got the history: system, user, assistant (as spoken), user...
    last = stand.chat_requests[2]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in last if m["role"] == "user"] == TRANSCRIPTS
    assert last[2]["content"] == turns[0].reply_text and turns[0].reply_text

    # each turn's prompt: both sides' earlier audio, with their speaker ids, in order
    user_codes = [csm.encode_audio(read_clip(w, "w")) for w in wavs]
    for k, rec in enumerate(session.prompts):
        expected = []
        for j in range(k):
            expected += [(1, user_codes[j]), (0, None)]
        expected.append((1, user_codes[k]))
        assert [s.speaker for s in rec.context] == [sp for sp, _ in expected]
        for seg, (sp, codes) in zip(rec.context, expected):
            assert seg.codes is not None and len(seg.codes) > 0
            if codes is not None:
                np.testing.assert_array_equal(seg.codes, codes)
        # the assistant's segments are the codes it generated (and played) in the earlier turns
        asst = [s for s in rec.context if s.speaker == 0]
        assert [len(s.codes) for s in asst] == [t.frames for t in turns[:k]]
        rows = _audio_rows(csm, rec.context)
        np.testing.assert_array_equal(rows, np.concatenate([s.codes for s in rec.context]))

    # speech started before the chat stream ended
    for t, last_tok in zip(turns, stand.last_token_t):
        assert t.t_first_audio is not None and t.t_first_audio < last_tok
        lat = t.latency
        assert lat["transcription"] > 0 and lat["llm_first_token"] > 0 and lat["csm_first_audio"] > 0
        assert abs(lat["total"] - (lat["transcription"] + lat["llm_first_token"] + lat["csm_first_audio"])) < 1e-6

    # barge-in: the third reply is cut at what was played (3 frames), in the audio and in the context
    assert not turns[0].interrupted and turns[0].frames > 3
    assert turns[2].interrupted and turns[2].frames == 3 and len(turns[2].audio) == 3 * 1920
    assert session.context[-1].speaker == 0 and len(session.context[-1].codes) == 3
    assert session.history[-1] == {"role": "assistant", "content": turns[2].reply_text}
    assert len(turns[2].reply_text) < len(REPLY)


def test_unreachable_or_failing_endpoints_then_back(csm):
    stand = StandIns()
    port = free_port()
    logs: list[str] = []
    url = f"http://127.0.0.1:{port}"
    session = TalkSession(csm, llm_url=url, asr_url=url, temperature=0.0, max_audio_length_ms=SENT_MS,
                          log=logs.append)
    t1 = session.turn(_user_wav(0))  # nothing listens: the ASR is unreachable
    assert t1.error and "ASR endpoint" in t1.error and "unreachable" in t1.error and "\n" not in t1.error
    t2 = session.turn(text="Typed hello.")  # the LLM is unreachable too
    assert t2.error and "LLM endpoint" in t2.error and "unreachable" in t2.error
    assert len(logs) == 2 and all("the conversation goes on" in m for m in logs)

    server = Server(stand.app)
    server.port, server.url = port, url
    import uvicorn
    server.server = uvicorn.Server(uvicorn.Config(stand.app, host="127.0.0.1", port=port, log_level="warning"))
    server.thread = __import__("threading").Thread(target=server.server.run, daemon=True)
    server.start()
    try:
        stand.fail_llm = True
        t3 = session.turn(text="Are you there?")
        assert t3.error and "HTTP 503" in t3.error and "model is loading" in t3.error
        stand.fail_llm = False
        t4 = session.turn(_user_wav(1))  # back: the conversation goes on
    finally:
        server.stop()
    assert t4.error is None and t4.frames > 0 and t4.user_text == TRANSCRIPTS[0]
    # the typed turns stayed in the conversation (text only, no audio); the failed ASR turn did not
    assert [m["content"] for m in stand.chat_requests[0] if m["role"] == "user"] == \
        ["Typed hello.", "Are you there?", TRANSCRIPTS[0]]


def test_cli_talk_writes_a_wav_per_turn_and_reports_latency(tmp_path):
    stand = StandIns()
    server = Server(stand.app).start()
    try:
        wav = tmp_path / "q.wav"
        wav.write_bytes(_user_wav(0))
        r = subprocess.run([sys.executable, "-m", "csmserve", "talk", "--model", "dummy-tiny", "--device", "cpu",
                            "--input-wav", str(wav), "--input-wav", str(wav), "--asr-url", server.url,
                            "--llm-url", server.url, "--out-dir", str(tmp_path / "out"), "--temperature", "0",
                            "--max-audio-length-ms", str(SENT_MS), "--barge-in-after-ms", "400"],
                           capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["turn-01.wav", "turn-02.wav"]
    lines = [ln for ln in r.stderr.splitlines() if "latency" in ln]
    assert len(lines) == 2 and all("transcription" in ln and "LLM first token" in ln and "CSM first audio" in ln
                                   for ln in lines)
    assert "cut: barge-in" in lines[0]
    import wave
    with wave.open(str(tmp_path / "out" / "turn-01.wav")) as w:
        assert w.getframerate() == 24_000 and w.getnframes() == 5 * 1920


def test_cli_talk_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "csmserve", "talk", "--llm-url", "http://x", "--input-wav", "a.wav"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--asr-url" in r.stderr
    for flag, value in (("--temperature", "-1"), ("--top-k", str(2**40)), ("--seed", "-1"),
                        ("--max-audio-length-ms", "10")):  # refused before anything loads, as speak does
        r = subprocess.run([sys.executable, "-m", "csmserve", "talk", "--llm-url", "http://x", "--typed", flag, value],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(f"csmserve talk: error: {flag} "), \
            (flag, r.stderr)
    r = subprocess.run([sys.executable, "-m", "csmserve", "talk", "--model", "dummy-tiny", "--device", "cpu",
                        "--llm-url", f"http://127.0.0.1:{free_port()}", "--typed", "--out-dir", str(tmp_path)],
                       input="Hello.\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "LLM endpoint" in err[0] and "unreachable" in err[0] and "goes on" in err[0]


@pytest.mark.serial  # speech must start before the chat stream ends: real-time overlap, not beside another worker
def test_three_turns_through_a_csmserve_server(csm, tmp_path):
    """--url: CSM behind `csmserve serve`, over its WebSocket with one context_id."""
    from csmserve.config import ServerConfig
    from csmserve.server import create_app

    stand = StandIns()
    endpoints = Server(stand.app).start()
    server = Server(create_app(csm, ServerConfig(voices_db=str(tmp_path / "v.db")))).start()
    try:
        session = TalkSession(None, llm_url=endpoints.url, asr_url=endpoints.url, url=server.url, speaker=0,
                              user_speaker=1, temperature=0.0, max_audio_length_ms=SENT_MS, log=lambda s: None)
        turns = [session.turn(_user_wav(0)), session.turn(text="Tell me more."),
                 session.turn(_user_wav(2), barge_in_after_ms=3 * 80)]
        session.close()
        state = server.app.state.server
        s = state.sessions.get(session.context_id)
        tokens, mask = state.last_prompt
    finally:
        server.stop()
        endpoints.stop()
    assert [t.error for t in turns] == [None, None, None]
    for t, last_tok in zip(turns, stand.last_token_t):
        assert t.t_first_audio is not None and t.t_first_audio < last_tok and t.frames > 0
    # the server's session: both sides, each with its speaker id; the cut reply kept (cancel with audio_end_ms)
    # as the assistant's turn, exactly the frames played
    assert [t.role for t in s.turns] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    speakers = [{seg.speaker for seg in t.segments} for t in s.turns]
    assert speakers == [{1}, {0}, {1}, {0}, {1}, {0}]
    assert s.turns[0].frames == len(csm.encode_audio(read_clip(_user_wav(0), "w"))) and s.turns[2].frames == 0
    assert [s.turns[1].frames, s.turns[3].frames] == [turns[0].frames, turns[1].frames]
    assert turns[2].interrupted and turns[2].frames == 3 and s.turns[5].frames == 3
    # the third turn's prompt held the earlier turns' audio: user 1, assistant 1, (typed: none), assistant 2
    audio = int(mask[:, :32].all(1).sum())
    assert audio >= s.turns[0].frames + turns[0].frames + turns[1].frames + s.turns[4].frames


def _llm_app(*events: str | float) -> FastAPI:
    """A chat endpoint streaming `events` as they are (str) with pauses (float seconds) between them."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        async def gen():
            for e in events:
                if isinstance(e, float):
                    await asyncio.sleep(e)
                else:
                    yield e
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _piece(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"delta": {"content": text}}]}) + "\n\n"


def test_an_interrupt_while_the_llm_is_slow_stops_the_reply_there(csm):
    """The user barges in while CSM waits for the LLM's next sentence (3 s away): turn() returns at once, nothing
    after the interrupt is played, and only the sentence heard joins the history."""
    import threading

    server = Server(_llm_app(_piece("Hello there, friend."), _piece(" I am"), 3.0, _piece(" doing well today."),
                             "data: [DONE]\n\n")).start()
    calls, t_interrupt = [], []

    def on_audio(turn, pcm):
        calls.append(time.perf_counter())
        if len(calls) == 1:
            def later():
                time.sleep(0.3)
                t_interrupt.append(time.perf_counter())
                session.interrupt()
            threading.Thread(target=later, daemon=True).start()

    try:
        session = TalkSession(csm, llm_url=server.url, temperature=0.0, max_audio_length_ms=SENT_MS,
                              on_audio=on_audio)
        turn = session.turn(text="How are you?")
        returned = time.perf_counter()
    finally:
        server.stop()
    assert turn.interrupted and turn.error is None
    assert not [t for t in calls if t > t_interrupt[0]] and returned - t_interrupt[0] < 1.5
    assert turn.reply_text == "Hello there, friend." == session.history[-1]["content"]


def test_llm_events_as_the_sse_spec_writes_them():
    """Comments, an event's JSON over two data lines (joined with a newline), then [DONE]."""
    from csmserve.apps.talk.llm import LLMStream

    server = Server(_llm_app(": keep-alive\n\n", 'data: {"choices": [{"delta":\ndata:  {"content": "Hi"}}]}\n\n',
                             _piece(" there."), "data: [DONE]\n\n")).start()
    try:
        assert "".join(LLMStream(server.url, "m", [{"role": "user", "content": "hi"}])) == "Hi there."
    finally:
        server.stop()


def test_url_user_turns_keep_what_a_default_server_takes():
    """--url: a user turn's audio is cut to its last --max-clip-seconds of a default server (60 s), not the 120 s a
    file given to talk may have: a longer turn was refused (400 audio_too_long) and the turn failed."""
    from csmserve.apps.talk.speech import ServerSpeech
    from csmserve.config import ServerConfig

    speech = ServerSpeech("http://127.0.0.1:9", "c", 0, 1, {})
    try:
        assert speech.conv.max_user_seconds == ServerConfig().max_clip_seconds == 60
    finally:
        speech.close()
