"""Encoder: the base of every format's streaming encoder (audio/encoders.py, lame.py, opus.py).
Validates chunks, applies `speed` (atempo, audio/tempo.py), then hands mono float32 PCM to `_encode`."""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from csmserve.audio.tempo import TimeStretch, check_speed
from csmserve.config import SAMPLE_RATE


class Encoder:
    format: ClassVar[str]
    media_type: ClassVar[str]
    heavy: ClassVar[bool] = False  # a codec: ms of CPU per second of audio, in libav or a library (GIL released)

    def __init__(self, sample_rate: int = SAMPLE_RATE, speed: float = 1.0) -> None:
        self.sample_rate = sample_rate
        self.speed = check_speed(speed)
        self.stretch = TimeStretch(sample_rate, speed) if self.speed != 1.0 else None
        self.stretched = 0  # samples out of the stretch so far
        self.closed = False

    def write(self, pcm: np.ndarray) -> bytes:
        if self.closed:
            raise RuntimeError("write() after close()")
        pcm = np.asarray(pcm)
        if pcm.ndim == 2 and 1 in pcm.shape:  # [1, n] or [n, 1]
            pcm = pcm.reshape(-1)
        if pcm.ndim != 1:
            raise ValueError(f"expected mono PCM of shape [n], got {pcm.shape}")
        pcm = np.ascontiguousarray(pcm, dtype=np.float32)
        if self.stretch is not None:
            pcm = self.stretch.write(pcm)
            self.stretched += pcm.size
        return self._encode(pcm) if pcm.size else b""

    def close(self) -> bytes:
        if self.closed:
            return b""
        self.closed = True
        tail = b""
        if self.stretch is not None:
            # atempo's output is only about input / speed long: its tail cut or padded (zeros) so the whole is
            # exactly round(input / speed), the length the timestamps and the usage count say
            pcm, want = self.stretch.flush(), max(0, round(self.stretch.num_in / self.speed) - self.stretched)
            pcm = pcm[:want] if pcm.size >= want else np.concatenate([pcm, np.zeros(want - pcm.size, np.float32)])
            tail = self._encode(pcm) if pcm.size else b""
        return tail + self._finish()

    def _encode(self, pcm: np.ndarray) -> bytes:  # pcm: [n>0] float32
        raise NotImplementedError

    def _finish(self) -> bytes:
        return b""


def compression_level(fmt: str, codec_options: dict[str, str] | None, default: int, top: int) -> int:
    """The one codec option the direct encoders take (lame.py, opus.py): compression_level in 0..top."""
    options = dict(codec_options or {})
    level = int(options.pop("compression_level", default))
    if options:
        raise ValueError(f"{fmt} takes only compression_level, got {sorted(options)}")
    if not 0 <= level <= top:
        raise ValueError(f"{fmt} compression_level must be in 0..{top}, got {level}")
    return level
