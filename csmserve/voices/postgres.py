"""The PostgreSQL backend of the voice store: one table shared by every replica of a cluster.

    store = PostgresVoiceStore("postgresql://csm:secret@db.internal:5432/csmserve")

No cache: every `get` reads the table, so a voice created through one replica is usable at once on
every other, and a deleted one is gone everywhere. Needs psycopg 3 (`pip install 'csmserve[postgres]'`).
One connection per store, guarded by a lock (the routes call it from worker threads); a connection the
server dropped is reopened once per call. Every statement has a timeout (`timeout_s`, --voices-db-timeout-s): a
server that stops answering costs a lookup that long, then VoiceStoreError (the routes' 503), not a worker thread
held for good.
"""
from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

from csmserve.voices.backend import _TABLE, VoiceBackend, VoiceStoreError

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


def connect_params(url: str, timeout_s: float) -> tuple[dict[str, Any], int | None]:
    """psycopg.connect's keyword arguments beside `url`, and the statement timeout to SET on each new connection
    (ms; None: the URL's options set their own). What the URL says wins (psycopg lets a keyword override it):
    connect_timeout, TCP keepalives and tcp_user_timeout only where it names none, so a dead host or a lost route
    ends a call too (the statement timeout is the server's: it cannot end a wait on a server gone silent)."""
    from psycopg.conninfo import conninfo_to_dict

    given = conninfo_to_dict(url)
    seconds = max(2, math.ceil(timeout_s))  # libpq's unit; it takes 1 as 2
    defaults = {"connect_timeout": seconds, "keepalives": 1, "keepalives_idle": seconds,
                "keepalives_interval": max(1, math.ceil(timeout_s / 3)), "keepalives_count": 3,
                "tcp_user_timeout": max(1, round(timeout_s * 1000))}
    kw: dict[str, Any] = {"autocommit": True, **{k: v for k, v in defaults.items() if k not in given}}
    # SET after connecting, not `options=-c statement_timeout`: PgBouncer refuses an `options` startup parameter
    options = str(given.get("options") or os.environ.get("PGOPTIONS", ""))
    return kw, None if "statement_timeout" in options else max(1, round(timeout_s * 1000))


class PostgresVoiceStore(VoiceBackend):
    _table, _param, _seq = "csmserve_voices", "%s", "seq"

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        try:
            import psycopg
        except ImportError:
            raise RuntimeError("a postgresql:// voices DB needs psycopg 3: pip install 'csmserve[postgres]'") from None
        self._psycopg, self._url, self._timeout_s = psycopg, url, timeout_s
        self._kw, self._statement_ms = connect_params(url, timeout_s)
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
        conn = self._psycopg.connect(self._url, **self._kw)
        if self._statement_ms is not None:
            conn.execute(f"SET statement_timeout = {int(self._statement_ms)}")
        return conn

    def _serialized(self, c, insert: Callable[[], int]) -> int:
        with c.transaction():  # the lock is held to the commit: the next create's count sees this row
            c.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK,))
            return insert()

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        """fn(connection) under the lock; a connection the server closed is reopened and fn run once more. A
        statement past the timeout, or a server that cannot be reached: VoiceStoreError."""
        with self._lock:
            try:
                try:
                    return fn(self._conn)
                except self._psycopg.OperationalError:
                    if not self._conn.closed:
                        raise
                    self._conn = self._connect()
                    return fn(self._conn)
            except self._psycopg.errors.QueryCanceled:
                raise VoiceStoreError(f"the voices DB {self.path} did not answer within {self._timeout_s:g} s "
                                      "(--voices-db-timeout-s)") from None
            except self._psycopg.OperationalError as e:
                first = " ".join(str(e).split())[:300]
                raise VoiceStoreError(f"the voices DB {self.path} failed ({type(e).__name__}: {first})") from None
