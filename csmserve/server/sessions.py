"""WebSocket conversation sessions: a context_id's voice, settings, fixed context and turns, kept across
connections until `close`, the idle timeout or eviction (bounded in number and per session).

With `path` (several API workers) sessions are also kept in a shared SQLite file, written through on every change
and re-read when another worker changed it (a version per session). A session is a row and a row per turn: a turn
added writes that turn (and the oldest, which history truncation may have cut), not the whole conversation.
"""
from __future__ import annotations

import dataclasses
import pickle
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from csmserve.config import ServerConfig
from csmserve.server.schemas import SamplingFields, VoiceRef, WsRequest

_SETTINGS = ("voice", "speaker", "temperature", "top_k", "top_p", "seed", "max_audio_length_ms",
             "max_segment_length_ms", "output_format", "add_timestamps")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    last_used REAL NOT NULL,
    data BLOB NOT NULL               -- pickle of a Session without its turns (our own types, our workers)
);
CREATE INDEX IF NOT EXISTS sessions_last_used ON sessions (last_used);
CREATE TABLE IF NOT EXISTS session_turns (
    id TEXT NOT NULL,                -- the session's
    seq INTEGER NOT NULL,            -- SessionTurn.seq: its order in the session
    data BLOB NOT NULL,              -- pickle of a SessionTurn
    PRIMARY KEY (id, seq)
);
"""


@dataclass
class SessionTurn:
    """One turn: `assistant` (generated here, a Segment per sentence as spoken) or `user` (`add_context`)."""

    role: str
    segments: list  # [Segment] with codes (int16: values < 2051) or text only
    request_id: str | None = None  # the request that generated an assistant turn (`truncate` names it)
    seq: int = 0  # its number in the session (Sessions.add_turn): its row in the shared store

    @property
    def frames(self) -> int:
        return sum(0 if s.codes is None else len(s.codes) for s in self.segments)


@dataclass
class Session:
    """A WebSocket `context_id`: its voice and settings, its fixed context and its turns."""

    context_id: str
    voice: str | VoiceRef = "alloy"
    model: str | None = None  # `model` / `adapter`: a LoRA adapter's name or a base name; None: as the voice says
    fields: SamplingFields = field(default_factory=SamplingFields)
    output_format: str = "pcm_s16le"
    add_timestamps: bool = False  # send `segment_done` (where each segment starts and ends in the audio)
    context: list = field(default_factory=list)  # [Segment] given with `context` (encoded once)
    turns: list[SessionTurn] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0  # turns generating now (in this process): never expired or evicted meanwhile
    version: int = 0  # bumped by every save (shared store: another worker's change is re-read)
    next_seq: int = 0  # the next turn's SessionTurn.seq

    def __getstate__(self) -> dict:
        return {**self.__dict__, "busy": 0}

    def update(self, msg: WsRequest) -> bool:
        """Take the settings the message gives; -> whether it gave any."""
        given, changed = msg.model_fields_set, False
        model = msg.adapter if msg.adapter is not None else msg.model
        if model is not None and model != self.model:
            self.model, changed = model, True
        for name in _SETTINGS:
            value = getattr(msg, name) if name in given else None
            if value is None:
                continue
            if name in ("voice", "output_format", "add_timestamps"):
                if getattr(self, name) != value:
                    setattr(self, name, value)
                    changed = True
            elif getattr(self.fields, name) != value:  # (a message repeating its settings: no store write)
                self.fields = self.fields.model_copy(update={name: value})
                changed = True
        return changed

    def history(self) -> list:
        """The turns' Segments, oldest first."""
        return [s for t in self.turns for s in t.segments]

    def drop_oldest_segments(self, n: int) -> None:
        for _ in range(n):
            self.drop_oldest_segment()

    def drop_oldest_segment(self) -> bool:
        """Forget the oldest segment of the conversation (the prompt would not fit); False when none is left."""
        while self.turns and not self.turns[0].segments:
            self.turns.pop(0)
        if not self.turns:
            return False
        self.turns[0].segments.pop(0)
        if not self.turns[0].segments:
            self.turns.pop(0)
        return True


class Sessions:
    """The sessions by context_id: LRU, bounded in number and per session, forgotten after `session_idle_s`."""

    def __init__(self, config: ServerConfig, clock: Callable[[], float] | None = None, path: str | None = None
                 ) -> None:
        self.config = config
        self.clock = clock or (time.time if path is not None else time.monotonic)  # shared: wall clock
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._db = _SessionDB(path) if path is not None else None

    def __len__(self) -> int:
        self.expire()
        return len(self._by_id) if self._db is None else self._db.count()

    def __contains__(self, context_id: str) -> bool:
        return self.get(context_id) is not None

    def get(self, context_id: str) -> Session | None:
        self.expire()
        s = self._by_id.get(context_id)
        if self._db is not None:
            s = self._reload(context_id, s)
        if s is not None:
            self.touch(s)
        return s

    def open(self, context_id: str) -> Session:
        """The session of `context_id`, created (empty) if there is none."""
        s = self.get(context_id)
        if s is None:
            while self._full() and self._evict_one():
                pass
            s = self._by_id[context_id] = Session(context_id, last_used=self.clock())
            self.save(s)
        return s

    def save(self, s: Session) -> None:
        """After a change to s: all of it written for every worker."""
        if self._db is not None and self._by_id.get(s.context_id) is s:
            s.version += 1
            for i, t in enumerate(s.turns):  # every row is rewritten: numbered afresh
                t.seq = i
            s.next_seq = len(s.turns)
            self._db.put(s)

    def touch(self, s: Session) -> None:
        s.last_used = self.clock()
        if self._by_id.get(s.context_id) is s:
            self._by_id.move_to_end(s.context_id)
            if self._db is not None:
                self._db.touch(s.context_id, s.last_used)

    def drop(self, context_id: str) -> None:
        self._by_id.pop(context_id, None)
        if self._db is not None:
            self._db.delete(context_id)

    def expire(self) -> None:
        cutoff = self.clock() - self.config.session_idle_s
        for cid, s in list(self._by_id.items()):  # least recently used first
            if s.last_used > cutoff:
                break
            if not s.busy:
                del self._by_id[cid]
        if self._db is not None:
            self._db.expire(cutoff, lambda: {cid for cid, s in self._by_id.items() if s.busy})

    def _full(self) -> bool:
        n = len(self._by_id) if self._db is None else self._db.count()
        return n >= self.config.max_sessions

    def _evict_one(self) -> bool:
        if self._db is not None:
            busy = {cid for cid, s in self._by_id.items() if s.busy}
            cid = self._db.oldest(exclude=busy)
            if cid is None:
                return False
            self._by_id.pop(cid, None)
            self._db.delete(cid)
            return True
        for cid, s in self._by_id.items():
            if not s.busy:
                del self._by_id[cid]
                return True
        return False

    def _reload(self, context_id: str, local: Session | None) -> Session | None:
        version = self._db.version(context_id)
        if version is None:  # gone (closed, expired or evicted by some worker)
            if local is not None and not local.busy:
                self._by_id.pop(context_id, None)
                return None
            return local
        if local is not None and local.version == version:
            return local
        s = self._db.load(context_id)
        if s is None:
            return local
        if local is not None:
            s.busy = local.busy
        self._by_id[context_id] = s
        return s

    def add_turn(self, s: Session, turn: SessionTurn) -> None:
        """Append a turn; then the oldest go while the session holds more turns or frames than allowed."""
        for seg in turn.segments:
            if seg.codes is not None:
                seg.codes = np.asarray(seg.codes, dtype=np.int16)
        turn.seq, s.next_seq = s.next_seq, s.next_seq + 1
        s.turns.append(turn)
        while len(s.turns) > self.config.max_session_turns:
            s.turns.pop(0)
        frames = sum(t.frames for t in s.turns)
        while len(s.turns) > 1 and frames > self.config.max_session_frames:
            frames -= s.turns.pop(0).frames
        s.last_used = self.clock()
        if self._by_id.get(s.context_id) is s:
            self._by_id.move_to_end(s.context_id)
            if self._db is not None:  # the new turn, and the oldest (Session.drop_oldest_segment cuts it)
                s.version += 1
                self._db.put_turns(s, {id(t): t for t in (s.turns[0], turn)}.values())


class _SessionDB:
    """The shared session table (SQLite, WAL: every API worker of one server opens the same file)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False, timeout=10.0, isolation_level=None)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # sessions are not durable data
            self._conn.executescript(_SCHEMA)
        self._last_expire = 0.0

    def _one(self, sql: str, args: tuple = ()):
        with self._lock:
            return self._conn.execute(sql, args).fetchone()

    def version(self, cid: str) -> int | None:
        row = self._one("SELECT version FROM sessions WHERE id = ?", (cid,))
        return None if row is None else row[0]

    def load(self, cid: str) -> Session | None:
        with self._lock:  # one read transaction: the session and its turns of one version
            self._conn.execute("BEGIN")
            try:
                row = self._conn.execute("SELECT data, version, last_used FROM sessions WHERE id = ?",
                                         (cid,)).fetchone()
                turns = self._conn.execute("SELECT data FROM session_turns WHERE id = ? ORDER BY seq",
                                           (cid,)).fetchall()
            finally:
                self._conn.execute("COMMIT")
        if row is None:
            return None
        s = pickle.loads(row[0])
        s.version, s.last_used = row[1], row[2]  # (put_turns and touch write these columns only)
        s.turns = [pickle.loads(t) for (t,) in turns]
        if s.turns:
            s.next_seq = max(s.next_seq, s.turns[-1].seq + 1)
        return s

    def put(self, s: Session) -> None:
        """All of s: its row and every turn's."""
        head = pickle.dumps(dataclasses.replace(s, turns=[]), protocol=5)
        with self._lock, self._conn:  # one transaction
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("INSERT INTO sessions (id, version, last_used, data) VALUES (?, ?, ?, ?) ON CONFLICT"
                               "(id) DO UPDATE SET version = excluded.version, last_used = excluded.last_used, "
                               "data = excluded.data", (s.context_id, s.version, s.last_used, head))
            self._conn.execute("DELETE FROM session_turns WHERE id = ?", (s.context_id,))
            self._conn.executemany("INSERT INTO session_turns (id, seq, data) VALUES (?, ?, ?)",
                                   [(s.context_id, t.seq, pickle.dumps(t, protocol=5)) for t in s.turns])

    def put_turns(self, s: Session, turns: Sequence[SessionTurn]) -> None:
        """`turns` of s written, the rows before s's oldest turn deleted, the version bumped."""
        first = s.turns[0].seq if s.turns else s.next_seq
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("UPDATE sessions SET version = ?, last_used = ? WHERE id = ?",
                               (s.version, s.last_used, s.context_id))
            self._conn.execute("DELETE FROM session_turns WHERE id = ? AND seq < ?", (s.context_id, first))
            self._conn.executemany("INSERT OR REPLACE INTO session_turns (id, seq, data) VALUES (?, ?, ?)",
                                   [(s.context_id, t.seq, pickle.dumps(t, protocol=5)) for t in turns])

    def touch(self, cid: str, t: float) -> None:
        with self._lock:
            self._conn.execute("UPDATE sessions SET last_used = ? WHERE id = ?", (t, cid))

    def delete(self, cid: str) -> None:
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM sessions WHERE id = ?", (cid,))
            self._conn.execute("DELETE FROM session_turns WHERE id = ?", (cid,))

    def count(self) -> int:
        return self._one("SELECT COUNT(*) FROM sessions")[0]

    def oldest(self, exclude: set[str]) -> str | None:
        with self._lock:
            for (cid,) in self._conn.execute("SELECT id FROM sessions ORDER BY last_used"):
                if cid not in exclude:
                    return cid
        return None

    def expire(self, cutoff: float, keep: Callable[[], set[str]]) -> None:
        now = time.monotonic()
        if now - self._last_expire < 1.0:  # at most once a second (and `keep` built only then)
            return
        self._last_expire = now
        ids = keep()
        marks = ",".join("?" * len(ids))
        old = f"last_used < ? AND id NOT IN ({marks})" if ids else "last_used < ?"
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute(f"DELETE FROM session_turns WHERE id IN (SELECT id FROM sessions WHERE {old})",
                               (cutoff, *ids))
            self._conn.execute(f"DELETE FROM sessions WHERE {old}", (cutoff, *ids))
