"""The frameworks' stock OpenAI TTS services, unmodified, against csmserve (dummy-tiny): Pipecat's
OpenAITTSService and LiveKit's openai.TTS with base_url. Audio at the rate and format they expect,
every request finished, and their cancel (an interruption) frees the engine slot."""
from __future__ import annotations

import asyncio
import dataclasses
import re

import httpx
import pytest

pipecat_tts = pytest.importorskip("pipecat.services.openai.tts", reason="pip install 'csmserve[test]'")
lk_openai = pytest.importorskip("livekit.plugins.openai", reason="pip install 'csmserve[test]'")

from pipecat.frames.frames import (  # noqa: E402
    InterruptionFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSStartedFrame, TTSStoppedFrame)
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from helpers import settle  # noqa: E402

FRAME_BYTES = 1920 * 2


def running_gauge(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(r"^csmserve:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def long_replies(server) -> None:
    """The stock services send no max_audio_length_ms: the server's default makes their replies long."""
    server.state.config = dataclasses.replace(server.state.config, default_audio_length_ms=60_000)


# ---------------------------------------------------------------- Pipecat
def pipecat_service(server, **kw):
    return pipecat_tts.OpenAITTSService(api_key="not-needed", base_url=f"{server.url}/v1",
                                        settings=pipecat_tts.OpenAITTSService.Settings(voice="alloy", **kw))


def test_pipecat_openai_tts_service_speaks_pcm_at_24k(server, csm):
    tts = pipecat_service(server, model="tts-1")
    down, _ = asyncio.run(run_test(tts, frames_to_send=[TTSSpeakFrame("Hello there. How are you today?"),
                                                        SleepFrame(2.0)]))
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all(f.sample_rate == 24_000 and f.num_channels == 1 for f in audio)
    (req,) = server.built
    assert req.reason in ("eos", "length") and req.frames > 0
    assert sum(len(f.audio) for f in audio) == req.frames * FRAME_BYTES  # every frame, s16le
    kinds = [type(f) for f in down if isinstance(f, (TTSStartedFrame, TTSStoppedFrame))]
    assert kinds == [TTSStartedFrame, TTSStoppedFrame]
    settle(csm)
    assert running_gauge(server) == 0


def test_pipecat_interruption_frees_the_slot(server, csm):
    tts = pipecat_service(server, model="tts-1")
    long_replies(server)
    # 1 s before the interruption: the first frames are out even on a busy 2-core CI machine (at 0.6 s one run had
    # none yet), and a minute of audio is far off
    frames = [TTSSpeakFrame("A very long answer that would go on for a whole minute."), SleepFrame(1.0),
              InterruptionFrame(), SleepFrame(0.5)]
    down, _ = asyncio.run(run_test(tts, frames_to_send=frames))
    settle(csm)  # the engine request is gone and every slot free
    (req,) = server.built
    assert req.reason == "closed" and 0 < req.frames < 60_000 // 80  # cut well before its end
    assert sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)) <= req.frames * FRAME_BYTES
    assert running_gauge(server) == 0


# ---------------------------------------------------------------- LiveKit
def livekit_tts(server, **kw):
    return lk_openai.TTS(base_url=f"{server.url}/v1", api_key="not-needed", voice="alloy", **kw)


async def synthesize(tts, text: str, stop_after: int | None = None) -> list:
    frames = []
    stream = tts.synthesize(text)
    try:
        async for ev in stream:
            frames.append(ev.frame)
            if stop_after is not None and len(frames) >= stop_after:
                break
    finally:
        await stream.aclose()
        await tts.aclose()
    return frames


@pytest.mark.parametrize("model,fmt", [("tts-1", "pcm"), ("gpt-4o-mini-tts", "pcm"), ("gpt-4o-mini-tts", "mp3"),
                                       ("tts-1", "opus"), ("tts-1", "aac"), ("tts-1", "flac"), ("tts-1", "wav")])
def test_livekit_openai_tts_every_way(server, csm, model, fmt):
    """tts-1: the audio bytes; gpt-4o-mini-tts: the SSE stream (speech.audio.delta); decoded by LiveKit."""
    frames = asyncio.run(synthesize(livekit_tts(server, model=model, response_format=fmt), "Hello there. Bye."))
    assert frames and all(f.sample_rate == 24_000 and f.num_channels == 1 for f in frames)
    (req,) = server.built
    samples = sum(f.samples_per_channel for f in frames)
    if fmt == "pcm":  # every frame (LiveKit's emitter may end on a padded 10 ms frame)
        assert req.frames * 1920 <= samples <= req.frames * 1920 + 480, (samples, req.frames)
    else:  # a codec's priming and padding, at most a few hundred ms
        assert abs(samples - req.frames * 1920) <= 2 * 2048, (samples, req.frames)
    assert req.reason in ("eos", "length")
    settle(csm)
    assert running_gauge(server) == 0


def test_livekit_stream_closed_early_frees_the_slot(server, csm):
    long_replies(server)
    frames = asyncio.run(synthesize(livekit_tts(server, model="tts-1", response_format="pcm"),
                                    "A very long answer that would go on for a whole minute.", stop_after=1))
    assert len(frames) == 1
    settle(csm)
    (req,) = server.built
    assert req.reason == "closed" and req.frames < 60_000 // 80
    assert running_gauge(server) == 0
