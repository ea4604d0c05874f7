"""WebSocket conversation sessions: a context_id's voice, settings and turns across connections, user turns
encoded once, the idle timeout, and the bounds on memory (docs/api.md)."""
import base64
import json
import time

import numpy as np
import pytest
from websockets.sync.client import connect

from csmserve.api import Segment
from csmserve.config import ServerConfig
from csmserve.server.sessions import Sessions, SessionTurn
from server_helpers import metrics, wait_idle, wait_metrics, wav_bytes
from test_ws import audio_rows, turn, ws_url


@pytest.mark.inproc
def test_a_session_survives_across_connections(server):
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "conv-1", "text": "Hello there.", "flush": True, "voice": "alloy",
                            "temperature": 0, "max_audio_length_ms": 240}))
        _, msgs = turn(ws)
        first = msgs[-1]["num_frames"]
        assert 0 < first <= 3 and audio_rows(server) == 0
    with connect(ws_url(server)) as ws:  # a new connection: same voice, settings and context
        ws.send(json.dumps({"context_id": "conv-1", "text": "Where were we?", "flush": True}))
        _, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done" and msgs[-1]["num_frames"] <= 3  # max_audio_length_ms kept
        tokens, _ = server.state.last_prompt
        assert audio_rows(server) == first + 1  # the first turn's codes (+ EOS frame) condition this one
        assert b"Hello there." in bytes(tokens[:, 32].astype(np.uint8))
    s = server.state.sessions.get("conv-1")
    assert [t.role for t in s.turns] == ["assistant", "assistant"] and s.fields.temperature == 0


@pytest.mark.inproc
def test_user_turns_are_encoded_once(server, csm, monkeypatch):
    calls = []
    encode = csm.encode_audio
    monkeypatch.setattr(csm, "encode_audio", lambda wav: calls.append(1) or encode(wav))
    user = {"speaker": 1, "text": "What is the weather?", "audio": base64.b64encode(wav_bytes(0.4)).decode()}
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "u", "add_context": [user], "voice": "alloy",
                            "max_audio_length_ms": 160, "text": "Sunny.", "flush": True}))
        _, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done"
        user_frames = audio_rows(server) - 1
        assert user_frames == 5  # 0.4 s
        ws.send(json.dumps({"context_id": "u", "add_context": [{"speaker": 1, "text": "Thanks."}],
                            "text": "You are welcome.", "flush": True}))
        _, msgs = turn(ws)
        assert msgs[-1]["type"] == "flush_done"
        spoken = server.state.sessions.get("u").turns[1].frames  # the first answer (one segment)
        assert audio_rows(server) == (user_frames + 1) + (spoken + 1)  # the text-only user turn adds no audio
    assert len(calls) == 1
    assert [t.role for t in server.state.sessions.get("u").turns] == ["user", "assistant", "user", "assistant"]


def test_idle_timeout_forgets_the_session(serve):
    server = serve(session_idle_s=0.3)
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "idle", "text": "Remember me.", "flush": True,
                            "max_audio_length_ms": 160}))
        assert turn(ws)[1][-1]["type"] == "flush_done"
    assert "idle" in server.state.sessions
    time.sleep(0.5)
    assert "idle" not in server.state.sessions
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"context_id": "idle", "text": "Do you?", "flush": True, "max_audio_length_ms": 160}))
        assert turn(ws)[1][-1]["type"] == "flush_done"
        assert audio_rows(server) == 0  # a fresh session: no earlier turn


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _turn(frames: int) -> SessionTurn:
    return SessionTurn("assistant", [Segment(0, "x", codes=np.ones((frames, 32), np.int64))])


def test_sessions_bounds_and_expiry():
    clock = Clock()
    sessions = Sessions(ServerConfig(session_idle_s=10, max_sessions=2, max_session_turns=3,
                                     max_session_frames=10), clock)
    a = sessions.open("a")
    clock.t = 1
    sessions.open("b")
    clock.t = 2
    sessions.open("a")  # used: "b" is now the least recently used
    sessions.open("c")
    assert len(sessions) == 2 and "b" not in sessions and sessions.get("a") is a

    for n in (4, 4, 1, 1):
        sessions.add_turn(a, _turn(n))
    assert [t.frames for t in a.turns] == [4, 1, 1]  # at most 3 turns
    sessions.add_turn(a, _turn(6))
    assert [t.frames for t in a.turns] == [1, 1, 6]  # at most 10 frames
    assert a.turns[-1].segments[0].codes.dtype == np.int16  # stored small
    sessions.add_turn(a, _turn(30))
    assert [t.frames for t in a.turns] == [30]  # the newest turn is always kept

    assert a.drop_oldest_segment() and not a.turns and not a.drop_oldest_segment()

    clock.t = 20
    a.busy = 1  # generating: not expired
    assert "c" not in sessions and sessions.get("a") is a
    a.busy = 0
    clock.t = 40
    assert len(sessions) == 0


def test_a_growing_conversation_reuses_the_previous_turns_prefix(server):
    """Each turn of a context_id session prefills only what was added since the previous turn: the
    previous request's context is the longest cached prefix of this one's (the engine's counters, over
    /metrics, whichever API worker serves the turn)."""
    user = {"speaker": 1, "text": "Tell me a story.", "audio": base64.b64encode(wav_bytes(0.3)).decode()}
    names = ("csmserve:prefix_cache_hits", "csmserve:prefix_cache_hit_positions")
    hit_positions = []
    assert wait_idle(server)  # the procs server is the session's: earlier modules' requests have ended
    if server.state is None:
        time.sleep(0.5)  # and two heartbeats later every API worker's copy of the counters agrees
    hits, pos = metrics(server, *names)
    with connect(ws_url(server)) as ws:
        for i, text in enumerate(["Once upon a time.", "There was a fox.", "The end."]):
            msg = {"context_id": "grow", "text": text, "flush": True, "temperature": 0, "max_audio_length_ms": 160}
            if i == 0:
                msg |= {"voice": "alloy", "add_context": [user]}
            ws.send(json.dumps(msg))
            _, msgs = turn(ws)
            assert msgs[-1]["type"] == "flush_done"
            # the first turn misses (a fresh context), each later one hits once
            want = hits + (1 if i else 0)
            new_hits, new_pos = wait_metrics(server, lambda v: v[0] >= want, *names)
            if not i:
                time.sleep(0.5)  # a miss moves no counter to wait for: two heartbeats, then check none moved
                new_hits, new_pos = metrics(server, *names)
            assert new_hits == want, (i, hits, new_hits)
            hit_positions.append(new_pos - pos)
            hits, pos = new_hits, new_pos
    # turn 2 reuses turn 1's context (voice + user turn), turn 3 also turn 1's answer and turn 2's text
    assert 0 < hit_positions[1] < hit_positions[2]
