"""Sessions shared by API workers through one SQLite file: a session's row and a row per turn; a turn
added writes only itself (and the oldest kept), yet every worker reads the same conversation after
appends, bounds, history cut from the front, a truncated turn, turns added by the other worker, close
and expiry. A message repeating its settings writes nothing."""
from __future__ import annotations

import numpy as np

from csmserve.api import Segment
from csmserve.config import ServerConfig
from csmserve.server.schemas import WsRequest
from csmserve.server.sessions import Sessions, SessionTurn


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def _turn(rng, frames: int, segments: int = 1, role: str = "assistant") -> SessionTurn:
    return SessionTurn(role, [Segment(0, f"s{i}", codes=rng.integers(0, 2048, (frames, 32))) for i in range(segments)])


def _shape(s) -> list:
    return None if s is None else [(t.role, [(g.text, g.codes.tolist()) for g in t.segments]) for t in s.turns]


def _rows(sessions: Sessions) -> int:
    return sessions._db._one("SELECT COUNT(*) FROM session_turns")[0]


def test_two_workers_see_one_conversation(tmp_path):
    path, clock, rng = str(tmp_path / "s.db"), Clock(), np.random.default_rng(0)
    config = ServerConfig(max_session_turns=4, max_session_frames=100, session_idle_s=60)
    a, b = Sessions(config, clock, path), Sessions(config, clock, path)
    s = a.open("c")
    for n in (5, 6, 7, 8, 9):  # the fifth pushes the first out (at most 4 turns)
        a.add_turn(s, _turn(rng, n, segments=2))
    assert [t.frames for t in s.turns] == [12, 14, 16, 18] and _rows(a) == 4
    assert _shape(b.get("c")) == _shape(s)

    version = s.version
    msg = WsRequest.model_validate({"context_id": "c", "voice": "alloy", "temperature": 0.5})
    assert s.update(msg) and not s.update(msg)  # the same settings again: nothing to write
    a.save(s)
    assert s.version == version + 1 and b.get("c").fields.temperature == 0.5

    s.drop_oldest_segments(3)  # a turn's prompt did not fit: the first turn and a half go (in memory)
    a.add_turn(s, _turn(rng, 1))
    assert [len(t.segments) for t in s.turns] == [1, 2, 2, 1] and _rows(a) == 4
    assert _shape(b.get("c")) == _shape(s)

    s.turns[-2].segments = [Segment(0, "cut", codes=s.turns[-2].segments[0].codes[:3])]  # `truncate`
    a.save(s)
    assert _shape(b.get("c")) == _shape(s)

    sb = b.get("c")  # the next connection lands on the other worker
    b.add_turn(sb, _turn(rng, 2, role="user"))
    b.add_turn(sb, _turn(rng, 3))
    s = a.get("c")
    assert _shape(s) == _shape(sb) and len(s.turns) == 4 and s.turns[-1].frames == 3
    a.add_turn(s, _turn(rng, 4))  # numbered after the other worker's turns: none overwritten
    assert _shape(b.get("c")) == _shape(s) and [t.frames for t in s.turns][-3:] == [2, 3, 4]

    a.drop("c")
    assert b.get("c") is None and _rows(a) == 0

    s = a.open("d")
    a.add_turn(s, _turn(rng, 2))
    clock.t += 120  # idle past session_idle_s: its turns go with it
    a._db._last_expire = 0.0
    assert len(a) == 0 and _rows(a) == 0
