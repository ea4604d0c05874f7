"""POST /v1/audio/speech with several sentences: spoken in one slot, one continuous body."""
import httpx
import numpy as np

from server_helpers import wait_idle


def test_multi_sentence_input_is_one_long_form_stream(server):
    text = " ".join(f"Sentence {i} is short." for i in range(6))
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm",
            "max_segment_length_ms": 160, "max_audio_length_ms": 5000, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200
    pcm = np.frombuffer(r.content, "<i2")
    frames = len(pcm) // 1920
    assert len(pcm) == frames * 1920 and frames > 2  # more than one sentence's cap (2 frames): long-form
    assert frames <= 6 * 2
    assert wait_idle(server)


def test_one_sentence_is_capped_by_max_segment_length_ms_too(server):
    body = {"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "pcm",
            "max_segment_length_ms": 160, "temperature": 0}  # dummy-tiny never ends a sentence by itself
    r = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200
    assert len(r.content) == 2 * 1920 * 2  # 160 ms: 2 frames, not the default cap's
    assert wait_idle(server)
