"""POST /v1/audio/speech through the official openai client, unmodified."""
import base64
import json

import httpx
import numpy as np
import openai
import pytest

from server_helpers import SHORT_MS, decode_24k, wait_idle, wav_bytes

# extra samples a decoder may return beyond frames * 1920 (at 24 kHz): mp3 has lame's delay and
# padding (no Xing header to trim it), ADTS AAC its priming and padding; Opus trims exactly (48 kHz
# granules, +-1 resampler tail); flac/wav/pcm are exact
EXTRA = {"mp3": (0, 1105 + 576), "aac": (0, 2048), "opus": (-480, 480), "flac": (0, 0), "wav": (0, 0), "pcm": (0, 0)}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0)


def sse_events(lines) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def speak_sse(c: openai.OpenAI, seed: int, **extra) -> tuple[list[dict], bytes]:
    with c.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello there.", response_format=extra.pop("response_format", "pcm"),
            stream_format="sse", extra_body={"seed": seed, "max_audio_length_ms": SHORT_MS, **extra}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return events, audio


def test_sse_events_exact_shape_and_usage(server):
    events, audio = speak_sse(client(server), seed=7)
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"}
    assert all(set(e) == {"type", "audio"} for e in events[:-1])
    done = events[-1]
    assert set(done) == {"type", "usage"} and done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert set(usage) == {"input_tokens", "output_tokens", "total_tokens"}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    frames = usage["output_tokens"]
    assert 1 <= frames <= SHORT_MS // 80
    assert len(audio) == frames * 1920 * 2  # pcm s16le


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_openai_client_streams_every_format(server, fmt):
    c = client(server)
    events, _ = speak_sse(c, seed=11)
    frames = events[-1]["usage"]["output_tokens"]
    with c.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Hello there.", response_format=fmt,
            extra_body={"seed": 11, "max_audio_length_ms": SHORT_MS}) as r:
        assert r.status_code == 200
        assert r.headers.get("transfer-encoding") == "chunked"
        data = b"".join(r.iter_bytes())
    pcm = decode_24k(data, fmt)
    lo, hi = EXTRA[fmt]
    assert frames * 1920 + lo <= pcm.size <= frames * 1920 + hi, (fmt, frames, pcm.size)
    assert np.abs(pcm).max() > 0.01


@pytest.mark.parametrize("fmt", ["mp3", "wav"])
def test_sse_carries_the_chosen_format(server, fmt):
    events, audio = speak_sse(client(server), seed=3, response_format=fmt)
    frames = events[-1]["usage"]["output_tokens"]
    lo, hi = EXTRA[fmt]
    assert frames * 1920 + lo <= decode_24k(audio, fmt).size <= frames * 1920 + hi


def test_audio_arrives_while_generating(server):
    # many body chunks, the first long before the last: chunked transfer as the engine produces frames
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", timeout=60, json={
            "model": "tts-1", "voice": "alloy", "input": "streaming", "response_format": "pcm",
            "max_audio_length_ms": 800, "seed": 1}) as r:
        parts = [p for p in r.iter_raw() if p]
    assert len(parts) >= 3


@pytest.mark.inproc
def test_speed_instructions_voice_object_and_context(server):
    c = client(server)
    ctx = [{"speaker": 1, "text": "Hi, how are you?", "audio": base64.b64encode(wav_bytes(0.5)).decode()},
           {"speaker": 0, "text": "Fine, thanks."}]
    with c.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice={"id": "alloy"}, input="Glad to hear it.", response_format="wav",
            speed=2.0, instructions="Speak cheerfully.",
            extra_body={"seed": 5, "max_audio_length_ms": 800, "context": ctx, "speaker": 1,
                        "temperature": 0.7, "top_k": 20, "top_p": 0.9}) as r:
        data = r.read()
    pcm = decode_24k(data, "wav")
    tokens, mask = server.state.last_prompt
    assert mask[:, :32].any(axis=1).sum() in (6 + 1, 7 + 1)  # 0.5 s = 6.25 frames of context audio + EOS frame
    assert 0 < pcm.size <= 10 * 1920 / 2 + 2000  # speed 2: about half the frames' duration


def test_greedy_is_deterministic_and_seed_matters(server):
    c = client(server)
    a = speak_sse(c, seed=1)[1]
    b = speak_sse(c, seed=1)[1]
    d = speak_sse(c, seed=2)[1]
    assert a == b and a != d
    assert wait_idle(server)
