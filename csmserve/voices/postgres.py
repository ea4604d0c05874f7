"""The PostgreSQL backend of the voice store: one table shared by every replica of a cluster.

    store = PostgresVoiceStore("postgresql://csm:secret@db.internal:5432/csmserve")

No cache: every `get` reads the table, so a voice created through one replica is usable at once on
every other, and a deleted one is gone everywhere. Needs psycopg 3 (`pip install 'csmserve[postgres]'`).
One connection per store, guarded by a lock (the routes call it from worker threads); a connection the
server dropped is reopened once per call.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from csmserve.voices.backend import VoiceBackend

_SCHEMA = """
CREATE TABLE IF NOT EXISTS csmserve_voices (
    seq BIGSERIAL,                  -- insertion order: the tie-break of equal created_at
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    transcript TEXT NOT NULL,
    speaker INTEGER NOT NULL,
    sample_rate INTEGER NOT NULL,
    num_frames INTEGER NOT NULL,
    codes BYTEA NOT NULL,           -- [num_frames, 32] int16 little-endian, row-major
    created_at DOUBLE PRECISION NOT NULL,
    adapter TEXT                    -- the LoRA adapter it speaks with (NULL: the base model)
);
CREATE INDEX IF NOT EXISTS csmserve_voices_name ON csmserve_voices (name, created_at);
-- a table made before voices had an adapter (NULL: every old voice speaks with the base)
ALTER TABLE csmserve_voices ADD COLUMN IF NOT EXISTS adapter TEXT;
"""
_SCHEMA_LOCK = 0x63736D76  # pg_advisory_xact_lock key: replicas starting together create the table once


def display_url(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    from psycopg.conninfo import conninfo_to_dict

    d = conninfo_to_dict(url)
    user = f"{d['user']}@" if d.get("user") else ""
    port = f":{d['port']}" if d.get("port") else ""
    return f"postgresql://{user}{d.get('host', '')}{port}/{d.get('dbname', '')}"


class PostgresVoiceStore(VoiceBackend):
    _table, _param, _seq = "csmserve_voices", "%s", "seq"

    def __init__(self, url: str, connect_timeout: float = 10.0) -> None:
        try:
            import psycopg
        except ImportError:
            raise RuntimeError("a postgresql:// voices DB needs psycopg 3: pip install 'csmserve[postgres]'") from None
        self._psycopg, self._url, self._timeout = psycopg, url, connect_timeout
        self.path = display_url(url)
        self._lock = threading.Lock()
        self._conn = self._connect()
        with self._lock, self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            self._conn.execute(_SCHEMA)

    def _connect(self):
        return self._psycopg.connect(self._url, autocommit=True, connect_timeout=int(self._timeout))

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        """fn(connection) under the lock; a connection the server closed is reopened and fn run once more."""
        with self._lock:
            try:
                return fn(self._conn)
            except self._psycopg.OperationalError:
                if not self._conn.closed:
                    raise
                self._conn = self._connect()
                return fn(self._conn)
