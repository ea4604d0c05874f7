"""VoiceStore: the voice store in an SQLite file (one machine; several processes share it through WAL)."""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path


from csmserve.voices.backend import (_INFO_COLUMNS, Voice, VoiceBackend,
                                     VoiceInfo, _voice, default_db_path)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    transcript TEXT NOT NULL,
    speaker INTEGER NOT NULL,
    sample_rate INTEGER NOT NULL,
    num_frames INTEGER NOT NULL,
    codes BLOB NOT NULL,            -- [num_frames, 32] int16 little-endian, row-major
    created_at REAL NOT NULL,
    adapter TEXT                    -- the LoRA adapter it speaks with (NULL: the base model)
);
CREATE INDEX IF NOT EXISTS voices_name ON voices (name, created_at);
"""
# a database made before voices had an adapter: the column added (NULL: every old voice speaks with the base)
_MIGRATIONS = (("adapter", "ALTER TABLE voices ADD COLUMN adapter TEXT"),)

class VoiceStore(VoiceBackend):
    """SQLite-backed store. One connection guarded by a lock (safe across threads); WAL and a
    busy timeout let several processes share the file; every write is one transaction."""

    def __init__(self, path: str | Path | None = None) -> None:
        path = default_db_path() if path is None else path
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, timeout=10.0)
        with self._lock, self._conn:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.executescript(_SCHEMA)
            have = {row[1] for row in self._conn.execute("PRAGMA table_info(voices)")}
            for column, sql in _MIGRATIONS:
                if column not in have:
                    try:
                        self._conn.execute(sql)
                    except sqlite3.OperationalError as e:  # another process added it meanwhile
                        if "duplicate column" not in str(e):
                            raise

    def _insert(self, voice: Voice, codes: bytes) -> None:
        with self._lock, self._conn:
            self._conn.execute(
                f"INSERT INTO voices ({_INFO_COLUMNS}, codes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (voice.id, voice.name, voice.transcript, voice.speaker, voice.sample_rate,
                 voice.num_frames, voice.created_at, voice.adapter, codes))

    def get(self, id_or_name: str) -> Voice | None:
        """By id, else the newest voice with that name; None if neither exists."""
        sql = f"SELECT {_INFO_COLUMNS}, codes FROM voices WHERE {{}} = ? ORDER BY created_at DESC, rowid DESC LIMIT 1"
        with self._lock:
            row = self._conn.execute(sql.format("id"), (id_or_name,)).fetchone()
            row = row or self._conn.execute(sql.format("name"), (id_or_name,)).fetchone()
        return None if row is None else _voice(row)

    def list(self) -> list[VoiceInfo]:
        """All voices, oldest first, without their codes."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {_INFO_COLUMNS} FROM voices ORDER BY created_at, rowid").fetchall()
        return [VoiceInfo(*row) for row in rows]

    def delete(self, voice_id: str) -> bool:
        """Delete by id (names may repeat, so not by name). False if no such id."""
        with self._lock, self._conn:
            return self._conn.execute("DELETE FROM voices WHERE id = ?", (voice_id,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._conn.close()
