"""A turn cut at what was played: `cancel` with `audio_end_ms` keeps exactly those frames of the cancelled
turn in the session; `truncate` cuts a finished one (OpenAI Realtime's conversation.item.truncate)."""
import json

import numpy as np
import pytest
from websockets.sync.client import connect

from server_helpers import wait_slots_free
from test_ws import recv_json, turn, ws_url
from test_ws_stream import turn_codes

pytestmark = pytest.mark.inproc  # reads the sessions and prompts in server.state
GREEDY = {"voice": "alloy", "temperature": 0}


def full_codes(server, ws, cid: str, text: str, ms: int) -> np.ndarray:
    ws.send(json.dumps({"context_id": cid, "text": text, "flush": True, "max_segment_length_ms": ms, **GREEDY}))
    turn(ws)
    return turn_codes(server, cid)


def assistant_rows(server) -> np.ndarray:
    """The audio codes of the last prompt's context (every context turn's frames, EOS frames dropped)."""
    tokens, mask = server.state.last_prompt
    audio = tokens[mask[:, :32].any(axis=1), :32]
    return audio[audio.any(axis=1)]


def test_cancel_keeps_exactly_the_played_frames(server, csm):
    text = "A long answer that keeps going."
    with connect(ws_url(server)) as ws:
        reference = full_codes(server, ws, "ref", text, 30 * 80)  # what the same greedy turn generates whole
        ws.send(json.dumps({"context_id": "cut", "text": text, "flush": True, "max_audio_length_ms": 30 * 80,
                            **GREEDY}))
        got = 0
        while got < 5:
            m = recv_json(ws)
            assert m["type"] == "audio"
            got += m["num_frames"]
        ws.send(json.dumps({"context_id": "cut", "cancel": True, "audio_end_ms": 3 * 80 + 40}))  # 3.5 frames played
        _, msgs = turn(ws, until="cancelled")
        assert msgs[-1]["num_frames"] == 3 and msgs[-1]["request_id"].startswith("req-")
        assert wait_slots_free(csm) == csm.client.engine.scheduler.max_slots
        kept = turn_codes(server, "cut")
        np.testing.assert_array_equal(kept, reference[:3])  # the first three frames, as generated
        session = server.state.sessions.get("cut")
        assert [t.role for t in session.turns] == ["assistant"] and session.turns[0].segments[0].text == text
        ws.send(json.dumps({"context_id": "cut", "text": "And then?", "flush": True, "max_audio_length_ms": 160}))
        turn(ws)
        np.testing.assert_array_equal(assistant_rows(server), reference[:3])  # the next turn's prompt holds them


def test_cancel_without_audio_end_ms_drops_the_turn(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "drop", "text": "A long answer.", "flush": True,
                            "max_audio_length_ms": 30 * 80, **GREEDY}))
        assert recv_json(ws)["type"] == "audio"
        ws.send(json.dumps({"context_id": "drop", "cancel": True}))
        _, msgs = turn(ws, until="cancelled")
        assert msgs[-1] == {"type": "cancelled", "context_id": "drop"}
    assert server.state.sessions.get("drop").turns == []


def test_truncate_cuts_a_finished_turn(server):
    with connect(ws_url(server)) as ws:
        whole = full_codes(server, ws, "tr", "One sentence. And a second one.", 3 * 80)
        first_id = None
        for t in server.state.sessions.get("tr").turns:
            first_id = t.request_id
        n = len(whole)
        assert n >= 4
        ws.send(json.dumps({"context_id": "tr", "truncate": True, "audio_end_ms": 4 * 80 + 79}))
        m = recv_json(ws)
        assert m == {"type": "truncated", "context_id": "tr", "request_id": first_id, "num_frames": 4}
        np.testing.assert_array_equal(turn_codes(server, "tr"), whole[:4])
        ws.send(json.dumps({"context_id": "tr", "truncate": True, "audio_end_ms": 0, "request_id": first_id}))
        assert recv_json(ws)["num_frames"] == 0
        assert server.state.sessions.get("tr").turns == []  # nothing of it was played
        ws.send(json.dumps({"context_id": "tr", "truncate": True}))
        err = recv_json(ws)
        assert err["type"] == "error" and err["error"]["code"] == "missing_required_parameter"
        ws.send(json.dumps({"context_id": "tr", "truncate": True, "audio_end_ms": 80, "request_id": "req-none"}))
        err = recv_json(ws)
        assert err["type"] == "error" and err["error"]["param"] == "request_id"
        ws.send(json.dumps({"context_id": "tr", "truncate": True, "audio_end_ms": -1}))
        assert recv_json(ws)["error"]["param"] == "audio_end_ms"


def test_a_cancel_that_crosses_the_turn_s_end_stops_nothing(server, monkeypatch):
    """The turn is generated and kept while its flush_done is still being written (a slow socket: 0.5 s here); a
    cancel with audio_end_ms arriving then keeps the whole turn once (no cut copy beside it), flush_done first."""
    import asyncio

    from csmserve.server import ws as ws_mod

    send = ws_mod.Connection.send

    async def slow_flush_done(self, payload):
        if isinstance(payload, dict) and payload.get("type") == "flush_done":
            await asyncio.sleep(0.5)
        await send(self, payload)

    monkeypatch.setattr(ws_mod.Connection, "send", slow_flush_done)
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "c", "text": "Hello there.", "flush": True, "max_audio_length_ms": 400,
                            "max_segment_length_ms": 400, **GREEDY}))
        frames = 0
        while frames < 5:  # all 400 ms (random weights never end a sentence early)
            m = recv_json(ws)
            assert m["type"] == "audio", m
            frames += m["num_frames"]
        ws.send(json.dumps({"context_id": "c", "cancel": True, "audio_end_ms": 160}))
        kinds = [recv_json(ws)["type"] for _ in range(2)]
    assert kinds == ["flush_done", "cancelled"]
    turns = [t for t in server.state.sessions.get("c").turns if t.role == "assistant"]
    assert len(turns) == 1 and sum(len(s.codes) for s in turns[0].segments) == 5
