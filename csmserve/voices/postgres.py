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

from csmserve.voices.backend import _TABLE, VoiceBackend

# seq: insertion order, the tie-break of equal created_at; the ALTER: a table made before voices had an adapter
# (NULL: every old voice speaks with the base)
_SCHEMA = (_TABLE.format(table="csmserve_voices", seq="\n    seq BIGSERIAL,", bytes="BYTEA", double="DOUBLE PRECISION")
           + "ALTER TABLE csmserve_voices ADD COLUMN IF NOT EXISTS adapter TEXT;\n")
_SCHEMA_LOCK = 0x63736D76  # pg_advisory_xact_lock key: replicas starting together create the table once
# pg_advisory_xact_lock key of the capped creates (--max-voices): under READ COMMITTED two inserts would each count
# the table without the other's row and both pass a cap of one left; holding this one, each counts every create
# committed before it
_CREATE_LOCK = 0x63736D77


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
        try:
            self._conn = self._connect()
            with self._lock, self._conn.transaction():
                self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                self._conn.execute(_SCHEMA)
        except psycopg.Error as e:  # refused, no such database, bad credentials: one line
            first = " ".join(str(e).split())[:300]
            raise RuntimeError(f"cannot open the voices DB {self.path!r} ({type(e).__name__}: {first})") from None

    def _connect(self):
        return self._psycopg.connect(self._url, autocommit=True, connect_timeout=int(self._timeout))

    def _serialized(self, c, insert: Callable[[], int]) -> int:
        with c.transaction():  # the lock is held to the commit: the next create's count sees this row
            c.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK,))
            return insert()

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
