"""Ogg/Opus by libopus, called directly, with the Ogg pages written here (RFC 7845) and the settings
encoders.OpusEncoder (the libav path) shares (24 kHz mono in, 20 ms packets, VBR 32 kb/s, complexity 5 unless
codec_options say). make_encoder("opus") uses it where the library loads.

Pages: the OpusHead page (BOS) and the OpusTags page leave with the first write; then each write's whole
20 ms packets go out in one page (so bytes leave on every write of >= 480 samples), its granule position
the 48 kHz samples encoded so far. close() pads the last packet and encodes the look-ahead out; the last
page (EOS) carries pre-skip + the input's length, so decoders trim the padding exactly.
"""
from __future__ import annotations

import ctypes
import random
import struct
import weakref
import zlib
from functools import cache

import numpy as np

from csmserve.audio.base import Encoder, compression_level
from csmserve.audio.libs import native
from csmserve.config import SAMPLE_RATE

FORMAT, MEDIA_TYPE = "opus", "audio/ogg; codecs=opus"
BIT_RATE = 32_000
COMPLEXITY = 5  # libopus' 0..10; ServerConfig.opus_complexity

_APPLICATION_AUDIO = 2049
_SET_BITRATE, _SET_VBR, _SET_COMPLEXITY, _SET_VBR_CONSTRAINT, _GET_LOOKAHEAD = 4002, 4006, 4010, 4020, 4027
_MAX_PACKET = 4000  # bytes: libopus' recommended output buffer for one packet
_RATES = (8000, 12000, 16000, 24000, 48000)


@cache
def library() -> ctypes.CDLL | None:
    lib = native("opus")
    if lib is None or not hasattr(lib, "opus_encode_float"):
        return None
    lib.opus_encoder_create.restype = ctypes.c_void_p
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    # (enc, pcm [n] float32, n, out, out size) -> packet bytes or < 0
    lib.opus_encode_float.restype = ctypes.c_int32
    lib.opus_encode_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int32]
    lib.opus_encoder_ctl.restype = ctypes.c_int  # variadic: arguments passed as ctypes values
    lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    return lib


_BITREV8 = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


def ogg_crc(data: bytes) -> int:
    """Ogg's CRC-32 (polynomial 0x04C11DB7, MSB first, initial 0, no final xor), through zlib's reflected
    CRC-32 on bit-reversed bytes (C speed, not a Python loop over the page)."""
    raw = zlib.crc32(data.translate(_BITREV8), 0xFFFFFFFF) ^ 0xFFFFFFFF  # zlib: register in = ~value, out = ~register
    return int(f"{raw:032b}"[::-1], 2)


class OggPages:
    """One logical Ogg stream's pages: page(packets, granule, flags) -> bytes."""

    BOS, EOS = 0x02, 0x04

    def __init__(self, serial: int) -> None:
        self.serial, self.seq = serial, 0

    def page(self, packets: list[bytes], granule: int, flags: int = 0, step: int = 0) -> bytes:
        """`packets` (none spanning a page) as one page, or several if they need > 255 lacing values;
        granule: the position after the last packet, `step` each packet's share (for a split's earlier pages)."""
        out = []
        i = 0
        while True:  # <= 255 lacing values a page; every packet here is < 255 * 255 bytes
            lacing, body, j = bytearray(), [], i
            while j < len(packets) and len(lacing) + len(packets[j]) // 255 + 1 <= 255:
                n = len(packets[j])
                lacing += b"\xff" * (n // 255) + bytes([n % 255])
                body.append(packets[j])
                j += 1
            last = j >= len(packets)
            head = struct.pack("<4sBBqIIIB", b"OggS", 0, flags if last else flags & self.BOS,
                               granule - step * (len(packets) - j), self.serial, self.seq, 0, len(lacing))
            page = head + bytes(lacing) + b"".join(body)
            out.append(page[:22] + struct.pack("<I", ogg_crc(page)) + page[26:])  # the CRC over the page with 0 there
            self.seq += 1
            flags &= ~self.BOS
            i = j
            if last:
                return b"".join(out)


class LibopusEncoder(Encoder):
    format, media_type = FORMAT, MEDIA_TYPE
    heavy = True

    def __init__(self, sample_rate: int = SAMPLE_RATE, speed: float = 1.0,
                 codec_options: dict[str, str] | None = None) -> None:
        complexity = compression_level(FORMAT, codec_options, COMPLEXITY, 10)
        if sample_rate not in _RATES:
            raise ValueError(f"libopus takes {_RATES} Hz, not {sample_rate}")
        super().__init__(sample_rate, speed)
        lib = library()
        if lib is None:
            raise RuntimeError("libopus is not available")
        self.lib = lib
        err = ctypes.c_int(0)
        enc = lib.opus_encoder_create(sample_rate, 1, _APPLICATION_AUDIO, ctypes.byref(err))
        if not enc or err.value != 0:
            raise RuntimeError(f"opus_encoder_create failed ({err.value})")
        self.enc = enc
        self._free = weakref.finalize(self, lib.opus_encoder_destroy, enc)  # also for a stream dropped unclosed
        c_int = ctypes.c_int
        for request, value in ((_SET_BITRATE, BIT_RATE), (_SET_VBR, 1), (_SET_VBR_CONSTRAINT, 0),
                               (_SET_COMPLEXITY, complexity)):
            if lib.opus_encoder_ctl(ctypes.c_void_p(enc), c_int(request), c_int(value)) != 0:
                self._free()
                raise RuntimeError(f"opus_encoder_ctl({request}, {value}) failed")
        lookahead = ctypes.c_int32(0)
        lib.opus_encoder_ctl(ctypes.c_void_p(enc), c_int(_GET_LOOKAHEAD), ctypes.byref(lookahead))
        self.lookahead = lookahead.value  # input samples
        self.frame = sample_rate // 50  # 20 ms
        self.scale = 48000 // sample_rate  # granule positions count 48 kHz samples
        self.pre_skip = self.lookahead * self.scale
        self.pages = OggPages(random.getrandbits(32))
        self.pending = np.zeros(0, np.float32)  # < one frame of input not yet encoded
        self.frames = 0  # packets encoded
        self.samples_in = 0
        self.started = False
        self.out = ctypes.create_string_buffer(_MAX_PACKET)

    def _headers(self) -> bytes:
        self.started = True
        head = struct.pack("<8sBBHIhB", b"OpusHead", 1, 1, self.pre_skip, self.sample_rate, 0, 0)
        vendor = b"csmserve"
        tags = b"OpusTags" + struct.pack("<I", len(vendor)) + vendor + struct.pack("<I", 0)
        return self.pages.page([head], 0, OggPages.BOS) + self.pages.page([tags], 0)

    def _packets(self, pcm: np.ndarray) -> list[bytes]:  # pcm: [k * frame] float32, contiguous
        packets = []
        base = pcm.ctypes.data
        for i in range(pcm.size // self.frame):
            n = self.lib.opus_encode_float(self.enc, base + 4 * i * self.frame, self.frame, self.out, _MAX_PACKET)
            if n < 0:
                raise RuntimeError(f"opus_encode_float failed ({n})")
            packets.append(ctypes.string_at(self.out, n))
        self.frames += len(packets)
        return packets

    def _encode(self, pcm: np.ndarray) -> bytes:  # pcm: [n>0] float32
        self.samples_in += pcm.size
        if self.pending.size:
            pcm = np.concatenate([self.pending, pcm])
        whole = pcm.size - pcm.size % self.frame
        self.pending = pcm[whole:].copy()
        head = b"" if self.started else self._headers()
        if not whole:
            return head
        packets = self._packets(np.ascontiguousarray(pcm[:whole]))
        step = self.frame * self.scale
        return head + self.pages.page(packets, self.frames * step, step=step)

    def _finish(self) -> bytes:
        head = b"" if self.started else self._headers()
        # encode until every input sample is out past the look-ahead: pad with silence to whole frames
        need = self.samples_in + self.lookahead - self.frames * self.frame
        pad = max(need - self.pending.size, 0)
        pcm = np.concatenate([self.pending, np.zeros(pad, np.float32)])
        pcm = np.concatenate([pcm, np.zeros(-pcm.size % self.frame, np.float32)])
        packets = self._packets(pcm) if pcm.size else []
        if not packets and self.frames == 0:
            packets = self._packets(np.zeros(self.frame, np.float32))  # an empty stream: one silent packet
        self._free()
        return head + self.pages.page(packets, self.pre_skip + self.samples_in * self.scale, OggPages.EOS,
                                      step=self.frame * self.scale)
