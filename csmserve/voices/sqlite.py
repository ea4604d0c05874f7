"""VoiceStore: the voice store in an SQLite file (one machine; several processes share it through WAL)."""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from csmserve.voices.backend import _TABLE, VoiceBackend, default_db_path

_SCHEMA = _TABLE.format(table="voices", bytes="BLOB", double="REAL", seq="")


class VoiceStore(VoiceBackend):
    """SQLite-backed store. One connection guarded by a lock (safe across threads); WAL and a
    busy timeout let several processes share the file; every write is one transaction."""

    _table, _param, _seq = "voices", "?", "rowid"

    def __init__(self, path: str | Path | None = None) -> None:
        path = default_db_path() if path is None else path
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, timeout=10.0)
        with self._lock, self._conn:
            self._wal()
            self._conn.executescript(_SCHEMA)
            # a database made before voices had an adapter (NULL: every old voice speaks with the base)
            if "adapter" not in {row[1] for row in self._conn.execute("PRAGMA table_info(voices)")}:
                try:
                    self._conn.execute("ALTER TABLE voices ADD COLUMN adapter TEXT")
                except sqlite3.OperationalError as e:  # another process added it meanwhile
                    if "duplicate column" not in str(e):
                        raise

    def _wal(self, wait_s: float = 10.0) -> None:
        """WAL mode (a new file's first opener switches it; processes opening it at that moment find it locked:
        the busy timeout does not cover the switch, so they try again)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._lock, self._conn:
            return fn(self._conn)
