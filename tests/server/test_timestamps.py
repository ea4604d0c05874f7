"""Timestamps: SSE `speech.audio.segment` events and WebSocket `segment_done` messages say where each
segment starts and ends in the audio, exactly the frame counts (80 ms = 1920 samples per frame)."""
import base64
import json

import httpx
from websockets.sync.client import connect

from csmserve.prompt.segments import split_sentences
from test_speech import sse_events
from test_ws import FRAME_BYTES, turn, ws_url

TEXT = "Hello there,  my friend. This is a test\nof timestamps! Does it work? Yes."
BODY = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "stream_format": "sse",
        "temperature": 0, "max_segment_length_ms": 4 * 80, "add_timestamps": True}


def sse(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def test_sse_segment_events_are_the_frame_counts_of_the_audio_before_them(server):
    events = sse(server, BODY)
    texts = split_sentences(TEXT)
    segs = [e for e in events if e["type"] == "speech.audio.segment"]
    assert [e["segment"] for e in segs] == list(range(len(texts))) and [e["text"] for e in segs] == texts
    received = 0  # pcm bytes before each event: exactly the audio up to the segment's end
    for e in events:
        if e["type"] == "speech.audio.delta":
            received += len(base64.b64decode(e["audio"]))
        elif e["type"] == "speech.audio.segment":
            assert received == e["audio_end_ms"] * 24 * 2 == (e["frame_start"] + e["num_frames"]) * FRAME_BYTES, e
            assert e["audio_start_ms"] == e["frame_start"] * 80 and e["speaker"] == 0
            assert e["finish_reason"] in ("eos", "length")
            assert " ".join(TEXT[e["text_start"]:e["text_end"]].split()) == e["text"]
    assert [e["audio_start_ms"] for e in segs[1:]] == [e["audio_end_ms"] for e in segs[:-1]]  # contiguous
    assert segs[0]["audio_start_ms"] == 0
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == sum(e["num_frames"] for e in segs)
    assert received == done["usage"]["output_tokens"] * FRAME_BYTES


def test_sse_has_no_segment_events_unless_asked(server):
    events = sse(server, {**BODY, "add_timestamps": False})
    assert {e["type"] for e in events} == {"speech.audio.delta", "speech.audio.done"}


def test_speed_scales_the_timestamps(server):
    events = sse(server, {**BODY, "speed": 2.0})
    seg = [e for e in events if e["type"] == "speech.audio.segment"][0]
    assert seg["audio_end_ms"] == seg["num_frames"] * 80 / 2


def test_at_any_speed_the_audio_sent_ends_where_the_last_segment_does(server):
    """pcm has no codec delay: the samples sent are the last audio_end_ms exactly (atempo alone was ~30 ms short
    at 0.5 and ~100 ms at 0.25)."""
    for speed in (0.25, 0.5):
        events = sse(server, {**BODY, "speed": speed})
        segs = [e for e in events if e["type"] == "speech.audio.segment"]
        sent = sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta") // 2
        assert sent == round(segs[-1]["audio_end_ms"] * 24), (speed, sent, segs[-1]["audio_end_ms"])


def test_ws_segment_done_equals_the_audio_frames_of_each_segment(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "ts", "text": TEXT, "flush": True, "temperature": 0,
                            "max_segment_length_ms": 4 * 80, "add_timestamps": True}))
        audio, msgs = turn(ws)
    frames: dict[int, list[int]] = {}  # segment -> frame indices its audio messages carried
    for m in msgs:
        if m["type"] == "audio":
            frames.setdefault(m["segment"], []).extend(range(m["frame_start"], m["frame_start"] + m["num_frames"]))
    done = [m for m in msgs if m["type"] == "segment_done"]
    assert [m["segment"] for m in done] == sorted(frames) == list(range(len(split_sentences(TEXT))))
    for m in done:
        got = frames[m["segment"]]
        assert (m["frame_start"], m["num_frames"]) == (got[0], len(got))
        assert (m["audio_start_ms"], m["audio_end_ms"]) == (got[0] * 80, (got[-1] + 1) * 80)
        assert m["text"] and m["request_id"] == msgs[-1]["request_id"]
        # it comes after the segment's last audio message, before the next segment's first
        i = msgs.index(m)
        assert all(x["segment"] <= m["segment"] for x in msgs[:i] if x["type"] == "audio")
        assert all(x["segment"] > m["segment"] for x in msgs[i:] if x["type"] == "audio")
    assert done[-1]["audio_end_ms"] * 24 * 2 == len(audio) == msgs[-1]["num_frames"] * FRAME_BYTES
    with connect(ws_url(server)) as ws:  # the same text, not asked: no segment_done
        ws.send(json.dumps({"context_id": "ts2", "text": TEXT, "flush": True, "temperature": 0,
                            "max_audio_length_ms": 4 * 80}))
        _, msgs = turn(ws)
    assert not [m for m in msgs if m["type"] == "segment_done"]


def test_ws_binary_progress_segment_messages_carry_audio_start_ms(server):
    with connect(ws_url(server, "?binary=1&progress=1")) as ws:
        ws.send(json.dumps({"context_id": "ts-b", "text": TEXT, "flush": True, "temperature": 0,
                            "max_audio_length_ms": 3 * 80, "add_timestamps": True}))
        audio, msgs = turn(ws)
    starts = [m for m in msgs if m["type"] == "segment"]
    done = [m for m in msgs if m["type"] == "segment_done"]
    assert [m["audio_start_ms"] for m in starts] == [m["audio_start_ms"] for m in done]
    assert done[-1]["audio_end_ms"] * 48 == len(audio)
