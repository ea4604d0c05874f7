"""WebSocket: text streamed in goes into one open long-form request (same greedy codes as whole), generation
starts before the input ends, progress fields, cancel of a turn still taking text (docs/api.md)."""
import json
import re
import time

import numpy as np
import pytest
from websockets.sync.client import connect

from csmserve.prompt.segments import split_sentences
from server_helpers import wait_idle
from test_ws import FRAME_BYTES, recv_json, turn, ws_url

TEXT = "Hello there,  my friend. This is a test\nof streaming! Does it work? Yes."
SETTINGS = {"voice": "alloy", "temperature": 0, "max_segment_length_ms": 3 * 80, "max_audio_length_ms": 20_000}


def turn_codes(server, context_id: str) -> np.ndarray:
    """The test hook: the session keeps the last turn's codes, segment by segment."""
    last = server.state.sessions.get(context_id).turns[-1]
    assert last.role == "assistant"
    return np.concatenate([s.codes for s in last.segments]).astype(np.int64)


def check_progress(msgs: list[dict], received: str) -> None:
    audio = [m for m in msgs if m["type"] == "audio"]
    texts = split_sentences(received)
    assert [m["segment"] for m in audio] == sorted(m["segment"] for m in audio)
    for m in audio:
        assert m["text"] == texts[m["segment"]]
        assert " ".join(received[m["text_start"]:m["text_end"]].split()) == m["text"]
    starts = {m["segment"]: m["text_start"] for m in audio}
    assert list(starts.values()) == sorted(starts.values())
    done = msgs[-1]
    assert done["type"] == "flush_done" and done["num_segments"] == len(texts)
    assert done["num_frames"] == sum(m["num_frames"] for m in audio)
    assert done["text_end"] == len(received.rstrip())


@pytest.mark.inproc
def test_pieces_give_the_same_codes_as_whole_and_start_before_flush(server, csm):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "whole", "text": TEXT, "flush": True, **SETTINGS}))
        audio_whole, msgs_whole = turn(ws)
        check_progress(msgs_whole, TEXT)
        whole = turn_codes(server, "whole")
        assert msgs_whole[-1]["num_segments"] == 4

        pieces = re.findall(r"\S+\s*", TEXT)  # word by word, whitespace kept
        ws.send(json.dumps({"context_id": "pieces", **SETTINGS}))
        for p in pieces[:5]:  # "Hello there,  my friend. This ": the first sentence is complete
            ws.send(json.dumps({"context_id": "pieces", "text": p}))
            time.sleep(0.02)
        first = recv_json(ws)  # audio before the rest of the text (and before any flush) was sent
        assert first["type"] == "audio" and first["segment"] == 0 and first["text"] == "Hello there, my friend."
        assert (first["text_start"], first["text_end"]) == (0, len("Hello there,  my friend."))
        for p in pieces[5:]:
            ws.send(json.dumps({"context_id": "pieces", "text": p}))
            time.sleep(0.02)
        ws.send(json.dumps({"context_id": "pieces", "flush": True}))
        audio_rest, msgs = turn(ws)
        msgs = [first] + msgs
        check_progress(msgs, TEXT)
        np.testing.assert_array_equal(turn_codes(server, "pieces"), whole)
        assert [(m["segment"], m["text"]) for m in msgs if m["type"] == "audio"] == \
            [(m["segment"], m["text"]) for m in msgs_whole if m["type"] == "audio"]
        assert len(audio_rest) + FRAME_BYTES * first["num_frames"] == len(audio_whole)
    if hasattr(csm, "speak"):  # and the same as CSM.speak on the same text
        ref = np.concatenate([c.codes for c in csm.speak(TEXT, temperature=0.0, max_segment_length_ms=3 * 80)])
        np.testing.assert_array_equal(whole, ref)


def test_flush_without_a_sentence_end_and_close(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "p", "text": "no punctuation ", **SETTINGS}))
        ws.send(json.dumps({"context_id": "p", "text": "at all"}))
        ws.send(json.dumps({"context_id": "p", "close": True}))
        _, msgs = turn(ws, until="done")
        kinds = [m["type"] for m in msgs]
        assert kinds[-2:] == ["flush_done", "done"] and set(kinds[:-2]) <= {"audio"}
        assert all(m["text"] == "no punctuation at all" for m in msgs if m["type"] == "audio")
        assert server.state is None or "p" not in server.state.sessions  # close forgets the session


def test_binary_progress_messages(server):
    with connect(ws_url(server, "?binary=1&progress=1")) as ws:
        ws.send(json.dumps({"context_id": "b", "text": "One. Two.", "flush": True, **SETTINGS}))
        audio, msgs = turn(ws)
        segs = [m for m in msgs if m["type"] == "segment"]
        assert [m["segment"] for m in segs] == sorted({m["segment"] for m in segs})
        assert {m["text"] for m in segs} <= {"One.", "Two."}
        assert len(audio) == msgs[-1]["num_frames"] * FRAME_BYTES


def test_cancel_an_open_turn_frees_the_slot(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "c", "text": "Start speaking now. And", **SETTINGS}))
        assert recv_json(ws)["type"] == "audio"  # the request is open, waiting for more text
        ws.send(json.dumps({"context_id": "c", "cancel": True}))
        _, msgs = turn(ws, until="cancelled")
        assert msgs[-1] == {"type": "cancelled", "context_id": "c"}
        assert wait_idle(server)
        ws.send(json.dumps({"context_id": "c", "text": "Again.", "flush": True}))  # a new turn, same session
        _, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done" and msgs[-1]["num_frames"] <= 3
