"""Cloned voices: a clip's Mimi codes + its transcript, stored once. `VoiceBackend` is what every store is
(sqlite.py: one machine, the default; postgres.py: a cluster): the records, the queries, and the resolution
of a voice string.

Ids are unique (`voice_<24 hex>`); names may repeat (as in OpenAI's API). A voice string resolves, in order:
stored id, stored name (the newest with that name), OpenAI voice alias. So a stored voice named e.g. "alloy"
takes over that alias, which lets clients that only send OpenAI names (Pipecat) use a cloned voice. Aliases
carry no clip: they pick a CSM speaker id, and CSM speaks with whatever voice it draws for it (by the seed).
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

NUM_CODEBOOKS = 32
CODEBOOK_SIZE = 2048  # Mimi codes are 0..2047, so int16 holds them
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx",
                 "nova", "sage", "shimmer", "verse", "marin", "cedar")
VOICE_ID_PREFIX = "voice_"  # every stored voice's id starts so: a preset name is never a stored id
ALIASES: dict[str, int] = {name: i % 2 for i, name in enumerate(OPENAI_VOICES)}  # -> CSM speaker 0/1

_INFO_COLUMNS = "id, name, transcript, speaker, sample_rate, num_frames, created_at, adapter"
# every store's table, in its database's types; {seq}: an insertion-order column where the database has no rowid
_TABLE = """
CREATE TABLE IF NOT EXISTS {table} ({seq}
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    transcript TEXT NOT NULL,
    speaker INTEGER NOT NULL,
    sample_rate INTEGER NOT NULL,
    num_frames INTEGER NOT NULL,
    codes {bytes} NOT NULL,         -- [num_frames, 32] int16 little-endian, row-major
    created_at {double} NOT NULL,
    adapter TEXT                    -- the LoRA adapter it speaks with (NULL: the base model)
);
CREATE INDEX IF NOT EXISTS {table}_name ON {table} (name, created_at);
"""


class VoiceNotFoundError(KeyError):
    pass


class VoiceStoreError(RuntimeError):
    """The store's database failed or did not answer in time (the server answers 503: retry later)."""


class VoiceLimitError(Exception):
    """create() found `max_voices` voices stored: nothing was written (delete one first)."""


@dataclass(frozen=True)
class VoiceInfo:
    id: str
    name: str
    transcript: str
    speaker: int
    sample_rate: int  # rate of the audio the codes encode (Mimi: 24000)
    num_frames: int  # 80 ms Mimi frames
    created_at: float  # unix seconds
    adapter: str | None = None  # the LoRA adapter it speaks with (a request's `model` naming another wins)

    @property
    def duration_s(self) -> float:
        return self.num_frames * 0.08


@dataclass(frozen=True, eq=False)  # eq over an array is ambiguous
class Voice(VoiceInfo):
    codes: np.ndarray = field(kw_only=True)  # [num_frames, 32] int64


@dataclass(frozen=True)
class ResolvedVoice:
    speaker: int  # CSM speaker id for the generated turn
    voice: Voice | None  # the reference clip to put in the prompt; None for a bare alias


def default_db_path() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "csmserve" / "voices.db"


def _check_codes(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] != NUM_CODEBOOKS or codes.shape[0] == 0:
        raise ValueError(f"codes must have shape [T>0, {NUM_CODEBOOKS}], got {codes.shape}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    if codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
        raise ValueError(f"codes must be in [0, {CODEBOOK_SIZE})")
    return codes.astype("<i2")


class VoiceBackend(ABC):
    """Where voices live: a store gives its connection (`_run`) and its table's names; validation, ids, the
    queries and `resolve` are shared here. Every method is safe to call from several threads."""

    path: object  # where (shown in messages): a file path or a URL without its password

    def create(self, name: str, transcript: str, codes: np.ndarray, speaker: int = 0,
               sample_rate: int = 24_000, adapter: str | None = None, max_voices: int | None = None) -> Voice:
        """adapter: bind the voice to a LoRA adapter (by name: whether it is loaded is checked where it is used).
        max_voices: VoiceLimitError where this many are stored (None: no cap). The count is taken in the insert's
        own statement, which every store serializes with the other creates (see `_serialized`), so creates racing
        in several processes or replicas never pass the cap."""
        if not name or not name.strip():
            raise ValueError("voice name must not be empty")
        codes16 = _check_codes(codes)
        voice = Voice(id=f"{VOICE_ID_PREFIX}{uuid.uuid4().hex[:24]}", name=name, transcript=transcript,
                      speaker=int(speaker), sample_rate=int(sample_rate), num_frames=codes16.shape[0],
                      created_at=time.time(), adapter=adapter or None, codes=codes16.astype(np.int64))
        if not self._insert(voice, codes16.tobytes(), max_voices):
            raise VoiceLimitError(f"{max_voices} voices are stored, the most this server keeps; delete one first")
        return voice

    _table: str  # the voices table
    _param: str  # the driver's placeholder
    _seq: str  # the insertion-order column: the tie-break of equal created_at
    _lock: threading.Lock
    _conn: Any

    @abstractmethod
    def _run(self, fn: Callable[[Any], Any]) -> Any:
        """fn(connection) under the store's lock; a write in it is one transaction."""

    def _serialized(self, c: Any, insert: Callable[[], int]) -> int:
        """insert() (the capped INSERT) so that no other create commits between its count and its write. SQLite:
        as it is (an INSERT takes the database's write lock before it reads anything); a store whose database lets
        two inserts count at once (PostgreSQL's READ COMMITTED) takes a lock of its own around it."""
        return insert()

    def _insert(self, voice: Voice, codes: bytes, max_voices: int | None) -> bool:
        """Store one row (codes: [num_frames, 32] int16 little-endian, row-major) where fewer than max_voices are
        stored (None: always) -> whether it was stored."""
        row = (voice.id, voice.name, voice.transcript, voice.speaker, voice.sample_rate, voice.num_frames,
               voice.created_at, voice.adapter, codes)
        values = ", ".join([self._param] * 9)
        if max_voices is None:
            sql = f"INSERT INTO {self._table} ({_INFO_COLUMNS}, codes) VALUES ({values})"
            return self._run(lambda c: c.execute(sql, row).rowcount) > 0
        # the count and the write in one statement: a full table inserts nothing (rowcount 0)
        sql = (f"INSERT INTO {self._table} ({_INFO_COLUMNS}, codes) SELECT {values} "
               f"WHERE (SELECT COUNT(*) FROM {self._table}) < {self._param}")
        return self._run(lambda c: self._serialized(c, lambda: c.execute(sql, (*row, max_voices)).rowcount)) > 0

    def get(self, id_or_name: str) -> Voice | None:
        """By id, else the newest voice with that name; None if neither exists."""
        sql = (f"SELECT {_INFO_COLUMNS}, codes FROM {self._table} WHERE {{}} = {self._param} "
               f"ORDER BY created_at DESC, {self._seq} DESC LIMIT 1")

        def query(c):
            return (c.execute(sql.format("id"), (id_or_name,)).fetchone()
                    or c.execute(sql.format("name"), (id_or_name,)).fetchone())

        row = self._run(query)
        return None if row is None else _voice(row)

    def list(self) -> list[VoiceInfo]:
        """All voices, oldest first, without their codes."""
        sql = f"SELECT {_INFO_COLUMNS} FROM {self._table} ORDER BY created_at, {self._seq}"
        return [VoiceInfo(*row) for row in self._run(lambda c: c.execute(sql).fetchall())]

    def delete(self, voice_id: str) -> bool:
        """Delete by id (names may repeat, so not by name). False if no such id."""
        sql = f"DELETE FROM {self._table} WHERE id = {self._param}"
        return self._run(lambda c: c.execute(sql, (voice_id,)).rowcount) > 0

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def resolve(self, voice: str | dict) -> ResolvedVoice:
        """OpenAI `voice` (a string, or {"id": ...}) -> speaker id and optional stored clip."""
        key = voice.get("id") if isinstance(voice, dict) else voice
        if not isinstance(key, str) or not key:
            raise VoiceNotFoundError(f"invalid voice {voice!r}")
        if (stored := self.get(key)) is not None:
            return ResolvedVoice(speaker=stored.speaker, voice=stored)
        if key.lower() in ALIASES:
            return ResolvedVoice(speaker=ALIASES[key.lower()], voice=None)
        raise VoiceNotFoundError(f"voice {key!r} not found")

    def __enter__(self) -> VoiceBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _voice(row: tuple) -> Voice:
    # (id, name, transcript, speaker, sample_rate, num_frames, created_at, adapter, codes bytes) -> Voice
    codes = np.frombuffer(bytes(row[-1]), dtype="<i2").reshape(-1, NUM_CODEBOOKS).astype(np.int64)
    return Voice(*row[:-1], codes=codes)
