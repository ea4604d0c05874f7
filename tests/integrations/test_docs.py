"""Every snippet of docs/integrations.md, run against the dummy-tiny test server (its URL in place of
http://localhost:8000); the app's own pieces (a Pipecat transport, STT and LLM; LiveKit's Silero VAD and
room) are stand-ins."""
from __future__ import annotations

import asyncio
import re
import sys
import types
import wave
from pathlib import Path

import httpx
import pytest

pytest.importorskip("pipecat", reason="pip install 'csmserve[test]'")
pytest.importorskip("livekit.agents", reason="pip install 'csmserve[test]'")

from pipecat.frames.frames import (  # noqa: E402
    LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame, TTSAudioRawFrame, TTSSpeakFrame)
from pipecat.processors.frame_processor import FrameProcessor  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from helpers import settle  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def snippet(name: str, server) -> str:
    text = DOC.read_text()
    m = re.search(rf"<!-- snippet: {re.escape(name)} -->\n(```python\n(.*?)```|((?:\|.*\n)+))", text, re.S)
    assert m, f"no snippet {name!r} in {DOC}"
    body = m.group(2) if m.group(2) is not None else m.group(3)
    return body.replace("http://localhost:8000", server.url)


def run(name: str, server, tmp_path, monkeypatch, **namespace) -> dict:
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": f"snippet_{name.replace('-', '_')}", **namespace}
    exec(compile(snippet(name, server), f"{DOC.name}:{name}", "exec"), ns)  # noqa: S102 - our own docs
    return ns


def wav_seconds(path: Path) -> float:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        return w.getnframes() / 24_000


def test_doc_has_every_snippet():
    names = re.findall(r"<!-- snippet: (\S+) -->", DOC.read_text())
    assert sorted(names) == sorted(["pipecat-pipeline", "pipecat-offline", "pipecat-stock", "livekit-agent",
                                    "livekit-offline", "livekit-stock", "open-webui", "openai-sdk"])


class PassThrough(FrameProcessor):
    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)


class StandInTransport:
    def __init__(self) -> None:
        self._in, self._out = PassThrough(name="transport-in"), PassThrough(name="transport-out")

    def input(self) -> FrameProcessor:
        return self._in

    def output(self) -> FrameProcessor:
        return self._out


def test_pipecat_pipeline(server, csm, tmp_path, monkeypatch):
    ns = run("pipecat-pipeline", server, tmp_path, monkeypatch, transport=StandInTransport(),
             stt=PassThrough(name="stt"), llm=PassThrough(name="llm"))
    frames = [LLMFullResponseStartFrame(), LLMTextFrame("Hello there. "), LLMTextFrame("Bye."),
              LLMFullResponseEndFrame(), SleepFrame(2.0)]
    down, _ = asyncio.run(run_test(ns["pipeline"], frames_to_send=frames))
    assert sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)) == server.built[0].frames * 3840 > 0
    settle(csm)


def test_pipecat_offline(server, csm, tmp_path, monkeypatch):
    run("pipecat-offline", server, tmp_path, monkeypatch)
    assert wav_seconds(tmp_path / "reply.wav") == server.built[0].frames * 0.08 > 0
    settle(csm)


def test_pipecat_stock(server, csm, tmp_path, monkeypatch):
    ns = run("pipecat-stock", server, tmp_path, monkeypatch)
    down, _ = asyncio.run(run_test(ns["tts"], frames_to_send=[TTSSpeakFrame("Hi."), SleepFrame(1.5)]))
    assert sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)) == server.built[0].frames * 3840 > 0
    settle(csm)


def test_livekit_agent(server, csm, tmp_path, monkeypatch):
    from livekit.agents import AgentSession

    from csmserve.integrations.livekit import TTS, ConversationAgent

    silero = types.ModuleType("livekit.plugins.silero")  # not installed here: the VAD is the app's choice
    silero.VAD = types.SimpleNamespace(load=lambda: None)
    monkeypatch.setitem(sys.modules, "livekit.plugins.silero", silero)
    import livekit.plugins

    monkeypatch.setattr(livekit.plugins, "silero", silero, raising=False)
    started = []

    async def start(self, agent, room=None, **kw):
        started.append((self, agent, room))

    monkeypatch.setattr(AgentSession, "start", start)
    ns = run("livekit-agent", server, tmp_path, monkeypatch)
    room = object()
    asyncio.run(ns["entrypoint"](types.SimpleNamespace(room=room)))
    ((session, agent, got_room),) = started
    assert isinstance(session.tts, TTS) and isinstance(agent, ConversationAgent) and got_room is room
    assert session.tts.conversation.ws_url == server.url.replace("http", "ws") + "/v1/audio/speech/stream"


def test_livekit_offline(server, csm, tmp_path, monkeypatch):
    run("livekit-offline", server, tmp_path, monkeypatch)
    (built,) = server.built
    seconds = wav_seconds(tmp_path / "reply.wav")
    assert built.frames * 0.08 <= seconds <= built.frames * 0.08 + 0.02
    user = built.turns()[0]
    assert (user[0], user[1], len(user[2])) == (1, "Hi, who is this?", 13)  # one second of the user's audio
    settle(csm)


def test_livekit_stock(server, csm, tmp_path, monkeypatch):
    ns = run("livekit-stock", server, tmp_path, monkeypatch)

    async def go():
        frames = [ev.frame async for ev in ns["tts"].synthesize("Hi.")]
        await ns["tts"].aclose()
        return frames

    frames = asyncio.run(go())
    assert sum(f.samples_per_channel for f in frames) >= server.built[0].frames * 1920 > 0
    settle(csm)


def test_open_webui_settings(server, csm):
    rows = dict(re.findall(r"^\| ([^|]+?) \| (.+?) \|$", snippet("open-webui", server), re.M))
    base = re.search(r"`(http\S+)`", rows["API Base URL"]).group(1)
    model = re.search(r"`(\S+)`", rows["TTS Model"]).group(1)
    voice = re.search(r"`(\S+)`", rows["TTS Voice"]).group(1)
    assert re.search(r"`(\S+)`", rows["Text-to-Speech Engine"]).group(1) == "OpenAI"
    headers = {"Authorization": "Bearer anything"}
    # what Open WebUI calls with these settings: its voice and model lists, then one request per sentence
    assert voice in {v["id"] for v in httpx.get(f"{base}/audio/voices", headers=headers).json()["voices"]}
    assert model in {m["id"] for m in httpx.get(f"{base}/audio/models", headers=headers).json()["models"]}
    r = httpx.post(f"{base}/audio/speech", headers=headers, timeout=60,
                   json={"model": model, "input": "Hello from Open WebUI.", "voice": voice})
    assert r.status_code == 200 and r.headers["content-type"].startswith("audio/mpeg") and len(r.content) > 100
    settle(csm)


def test_openai_sdk(server, csm, tmp_path, monkeypatch, capsys):
    ns = run("openai-sdk", server, tmp_path, monkeypatch)
    assert (tmp_path / "hello.mp3").stat().st_size > 100
    assert len(ns["pcm"]) == server.built[1].frames * 3840 > 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(" ")[0] for ln in lines] == ["S1", "S2"] and lines[1].endswith("No, what happened?")
    assert len(ns["audio"]) == int(lines[-1].split(" ")[1].split("-")[1]) * 48  # the last line's end, exact
    settle(csm)
