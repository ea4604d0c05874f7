"""`csmserve speak`'s output: float PCM chunks (or Mimi codes) encoded into a file or stdout."""
from __future__ import annotations

import os
import stat
import struct
import sys
from pathlib import Path
from typing import IO

import numpy as np

from csmserve.apps.common import CLIError, from_pcm16
from csmserve.config import SAMPLE_RATE


class Output:
    """Encodes float PCM chunks into the chosen format and writes them to a file or stdout."""

    def __init__(self, path: str, fmt: str) -> None:
        self.path, self.fmt = path, fmt
        self.samples = 0
        self.codes: list[np.ndarray] = []
        self.encoder = None
        if fmt != "npy":
            try:
                from csmserve.audio import make_encoder
            except ImportError as e:
                raise CLIError(f"audio output needs PyAV ({e}): pip install av") from None
            self.encoder = make_encoder(fmt, SAMPLE_RATE)
        # an existing file is opened without truncating it (cut at the first write): a run that fails before any
        # audio (a wrong --model, no network) leaves it as it was; `discard` removes only a regular file this run
        # made or began to write (never a FIFO or a device such as /dev/null)
        self.created = self.regular = self._keep = False
        if path == "-":
            self.file: IO[bytes] = sys.stdout.buffer
        else:
            try:
                existed = os.path.exists(path)
                self._keep = existed and stat.S_ISREG(os.stat(path).st_mode)
                self.file = open(path, "r+b" if self._keep else "wb")
                self.created, self.regular = not existed, stat.S_ISREG(os.fstat(self.file.fileno()).st_mode)
            except OSError as e:
                raise CLIError(f"cannot write {path!r}: {e.strerror or e}") from None

    def write(self, audio: np.ndarray, codes: np.ndarray | None = None) -> None:
        self.samples += audio.size
        if codes is not None and self.fmt == "npy":
            self.codes.append(codes)
        if self.encoder is not None and audio.size:
            self._put(self.encoder.write(audio))

    def write_pcm16(self, data: bytes) -> None:
        """Raw s16le bytes (what --url asks the server for)."""
        if len(data) % 2:
            raise ValueError("odd number of PCM bytes")
        self.write(from_pcm16(data))

    def _begin(self) -> None:
        if self._keep:  # the first bytes: the old file's go
            self.file.truncate(0)
            self._keep = False

    def _put(self, data: bytes) -> None:
        if data:
            self._begin()
            self.file.write(data)
            self.file.flush()

    def discard(self) -> None:
        """After a failed run: close; a regular file this run made or began to write is removed (no half-written
        file left behind)."""
        if self.path == "-":
            return
        self.file.close()
        if self.regular and (self.created or not self._keep):
            Path(self.path).unlink(missing_ok=True)

    def close(self) -> None:
        if self.encoder is not None:
            self._put(self.encoder.close())
        self._begin()
        if self.fmt == "npy":
            codes = np.concatenate(self.codes) if self.codes else np.zeros((0, 32), np.int64)
            np.save(self.file, codes)
        data = self.samples * 2
        if self.fmt == "wav" and self.path != "-" and self.file.seekable() and data + 36 < 2**32:
            # the streaming header says 0xFFFFFFFF (unknown); a file can be rewritten with the real sizes
            self.file.seek(4)
            self.file.write(struct.pack("<I", 36 + data))
            self.file.seek(40)
            self.file.write(struct.pack("<I", data))
        if self.path != "-":
            self.file.close()

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE
