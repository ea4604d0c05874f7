"""The voice store: `open_voice_store(where)` picks a backend (a `postgresql://` URL: PostgresVoiceStore,
shared by every replica; else an SQLite path: VoiceStore). Records and the interface: backend.py."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from csmserve.voices.backend import (ALIASES, VOICE_ID_PREFIX, CODEBOOK_SIZE, NUM_CODEBOOKS, OPENAI_VOICES, ResolvedVoice, Voice,
                                     VoiceBackend, VoiceInfo, VoiceLimitError, VoiceNotFoundError,
                                     VoiceStoreError, default_db_path)
from csmserve.voices.sqlite import VoiceStore

__all__ = ["ALIASES", "VOICE_ID_PREFIX", "CODEBOOK_SIZE", "NUM_CODEBOOKS", "OPENAI_VOICES", "ResolvedVoice", "Voice", "VoiceBackend",
           "VoiceInfo", "VoiceLimitError", "VoiceNotFoundError", "VoiceStore",
           "VoiceStoreError", "default_db_path", "open_voice_store"]


def open_voice_store(where: str | Path | None = None, timeout_s: float = 10.0) -> VoiceBackend:
    """`postgresql://user:pass@host/db` (or `postgres://`) -> PostgresVoiceStore; else an SQLite file
    (None: the default path; ":memory:" for a private in-memory store). timeout_s: PostgreSQL's statement timeout
    and its connect timeout where the URL names none (--voices-db-timeout-s)."""
    if isinstance(where, str) and where.startswith(("postgresql://", "postgres://")):
        from csmserve.voices.postgres import PostgresVoiceStore

        return PostgresVoiceStore(where, timeout_s)
    try:
        return VoiceStore(where)
    except (sqlite3.Error, OSError) as e:  # not a database, a directory, no permission: one line
        raise RuntimeError(f"cannot open the voices DB {str(where)!r} ({type(e).__name__}: {e})") from None
