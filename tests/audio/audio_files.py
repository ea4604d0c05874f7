"""Audio files built byte by byte (RIFF/WAVE), so tests can make what no encoder writes: any channel
count or channel mask, any sample rate in the header, float samples of NaN / inf, 0 or 1 samples."""
from __future__ import annotations

import struct

import numpy as np

_PCM_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"  # KSDATAFORMAT_SUBTYPE_*


def raw_wav(channels: int = 1, rate: int = 24_000, samples: int = 24_000, bits: int = 16, float_: bool = False,
            extensible: bool = False, mask: int = 0, data: np.ndarray | None = None, hz: float = 220.0) -> bytes:
    """A WAV file: `data` [samples, channels] in [-1, 1] (default: a 0.3 tone in every channel).
    extensible: WAVE_FORMAT_EXTENSIBLE with `mask` as its channel mask (0: no positions)."""
    if data is None:
        tone = 0.3 * np.sin(2 * np.pi * hz * np.arange(samples) / max(rate, 1))
        data = np.repeat(tone[:, None], channels, 1)
    if float_:
        tag, raw = 3, np.asarray(data).astype("<f4" if bits == 32 else "<f8").tobytes()
    else:
        dtype = {8: "u1", 16: "<i2", 32: "<i4"}[bits]
        scaled = data * (2 ** (bits - 1) - 1) + (128 if bits == 8 else 0)
        tag, raw = 1, scaled.astype(dtype).tobytes()
    block = channels * bits // 8
    head = struct.pack("<HIIHH", channels, rate, rate * block, block, bits)
    if extensible:
        fmt = struct.pack("<H", 0xFFFE) + head + struct.pack("<HHI", 22, bits, mask) + struct.pack("<H", tag) \
            + _PCM_GUID_TAIL
    else:
        fmt = struct.pack("<H", tag) + head
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(raw)) + raw
    return b"RIFF" + struct.pack("<I", len(body)) + body
