"""mp3 by libmp3lame, called directly, with the settings encoders.Mp3Encoder (the libav path) shares (MPEG-2
Layer III at 24 kHz, mono, CBR 64 kb/s, no Xing/Info frame, no ID3 tag, LAME quality 7 unless codec_options
say): ~25% less CPU per stream (docs/benchmarks.md, Encoders). make_encoder("mp3") uses it where it loads.

LAME buffers internally and returns whole frames as they complete, so a write of 3,840 samples returns
the frames finished so far (the first write already holds some: its ~1,100-sample delay is < 3,840).
"""
from __future__ import annotations

import ctypes
import weakref
from functools import cache

import numpy as np

from csmserve.audio.base import Encoder, compression_level
from csmserve.audio.libs import native
from csmserve.config import SAMPLE_RATE

FORMAT, MEDIA_TYPE = "mp3", "audio/mpeg"
BIT_RATE = 64_000
QUALITY = 7  # LAME's 0 (best, slowest) .. 9; ServerConfig.mp3_compression_level
_MONO = 3  # MPEG_mode MONO
_SETTERS = ("lame_set_in_samplerate", "lame_set_out_samplerate", "lame_set_num_channels", "lame_set_mode",
            "lame_set_brate", "lame_set_quality", "lame_set_bWriteVbrTag")  # each (gfp, int)


@cache
def library() -> ctypes.CDLL | None:
    lib = native("mp3lame")
    if lib is None or not hasattr(lib, "lame_encode_buffer_ieee_float"):
        return None
    lib.lame_init.restype = ctypes.c_void_p
    lib.lame_init.argtypes = []
    for name in _SETTERS:
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.lame_init_params.argtypes = [ctypes.c_void_p]
    lib.lame_close.argtypes = [ctypes.c_void_p]
    # (gfp, left [n] float32 in [-1, 1], right (unused for mono), n, out, out size) -> bytes written or < 0
    lib.lame_encode_buffer_ieee_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.lame_encode_flush.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


class LameEncoder(Encoder):
    format, media_type = FORMAT, MEDIA_TYPE
    heavy = True

    def __init__(self, sample_rate: int = SAMPLE_RATE, speed: float = 1.0,
                 codec_options: dict[str, str] | None = None) -> None:
        quality = compression_level(FORMAT, codec_options, QUALITY, 9)
        super().__init__(sample_rate, speed)
        lib = library()
        if lib is None:
            raise RuntimeError("libmp3lame is not available")
        self.lib = lib
        gfp = lib.lame_init()
        if not gfp:
            raise MemoryError("lame_init failed")
        self.gfp = gfp
        self._free = weakref.finalize(self, lib.lame_close, gfp)  # also for a stream dropped unclosed
        for name, value in zip(_SETTERS, (sample_rate, sample_rate, 1, _MONO, BIT_RATE // 1000, quality, 0)):
            getattr(lib, name)(gfp, value)
        if lib.lame_init_params(gfp) != 0:
            self._free()
            raise ValueError(f"libmp3lame rejected {sample_rate} Hz mono at {BIT_RATE} b/s")
        self.out = ctypes.create_string_buffer(16384)

    def _room(self, n: int) -> int:
        need = n * 5 // 4 + 7200  # LAME's worst case for n samples
        if len(self.out) < need:
            self.out = ctypes.create_string_buffer(need)
        return len(self.out)

    def _encode(self, pcm: np.ndarray) -> bytes:  # pcm: [n>0] float32, contiguous (Encoder.write)
        room = self._room(pcm.size)
        n = self.lib.lame_encode_buffer_ieee_float(self.gfp, pcm.ctypes.data, None, pcm.size, self.out, room)
        if n < 0:
            raise RuntimeError(f"lame_encode_buffer_ieee_float failed ({n})")
        return ctypes.string_at(self.out, n)

    def _finish(self) -> bytes:
        n = self.lib.lame_encode_flush(self.gfp, self.out, len(self.out))  # the delay line, the last frame padded
        data = ctypes.string_at(self.out, n) if n > 0 else b""
        self._free()
        return data
