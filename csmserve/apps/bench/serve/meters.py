"""How much audio has arrived: bytes of a response body in, seconds of playable audio out, without decoding.

    meter = make_meter("mp3")
    for data in body:                # any split, a frame may straddle two pieces
        seconds = meter.feed(data)   # complete frames so far (also meter.seconds)

Each format is read from its framing alone:
  pcm   24 kHz s16le: bytes / 48,000
  wav   the RIFF chunks up to `data` (rate and sample size from `fmt `), then bytes
  mp3   MPEG audio frame headers (length from bitrate, rate and padding); MPEG-2 Layer III at 24 kHz
        is 576 samples a frame. An ID3v2 tag is skipped; a lost sync scans for the next frame.
  opus  Ogg pages: a page is complete once its segment table's bytes are in; the last complete
        page's granule position (48 kHz) less OpusHead's pre-skip

(flac and aac, which no benchmark measured, had meters until issue 41: `git show b0a5770:<this file>`.)
"""
from __future__ import annotations

import struct

PCM_RATE = 24_000


class PcmMeter:
    def __init__(self, rate: int = PCM_RATE, sample_bytes: int = 2) -> None:
        self.seconds = 0.0
        self.bytes_per_s = rate * sample_bytes
        self.sample_bytes = sample_bytes
        self.nbytes = 0

    def feed(self, data: bytes) -> float:
        self.nbytes += len(data)
        self.seconds = (self.nbytes - self.nbytes % self.sample_bytes) / self.bytes_per_s
        return self.seconds


class WavMeter:
    """RIFF/WAVE: chunks up to `data`, then PCM bytes (the streaming header's sizes are 0xFFFFFFFF)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.head = b""
        self.pcm: PcmMeter | None = None

    def feed(self, data: bytes) -> float:
        if self.pcm is not None:
            self.seconds = self.pcm.feed(data)
            return self.seconds
        self.head += data
        rate, width, pos = PCM_RATE, 2, 12
        if len(self.head) >= 12 and self.head[:4] != b"RIFF":
            raise ValueError("not a RIFF/WAVE stream")
        while len(self.head) >= pos + 8:
            cid, size = self.head[pos:pos + 4], struct.unpack_from("<I", self.head, pos + 4)[0]
            if cid == b"data":
                self.pcm = PcmMeter(rate, width)
                rest, self.head = self.head[pos + 8:], b""
                self.seconds = self.pcm.feed(rest)
                return self.seconds
            if len(self.head) < pos + 8 + size:
                break
            if cid == b"fmt ":
                channels, rate = struct.unpack_from("<HI", self.head, pos + 10)
                width = channels * struct.unpack_from("<H", self.head, pos + 22)[0] // 8
            pos += 8 + size + (size & 1)
        return self.seconds


# MPEG audio: bitrate (kbit/s) by [MPEG-1?][layer III] index; sample rate by version
_MP3_BITRATES = {
    True: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 0),  # MPEG-1 Layer III
    False: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 0),  # MPEG-2 / 2.5 Layer III
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def mp3_frame(h: bytes | bytearray, i: int) -> tuple[int, int, int] | None:
    """The Layer III frame header at h[i:i+4] -> (frame bytes, samples, sample rate), or None if it is not one."""
    b1, b2 = h[i + 1], h[i + 2]
    if h[i] != 0xFF or (b1 & 0xE0) != 0xE0:
        return None
    version, layer = (b1 >> 3) & 3, (b1 >> 1) & 3
    br_idx, sr_idx, pad = b2 >> 4, (b2 >> 2) & 3, (b2 >> 1) & 1
    if version == 1 or layer != 1 or br_idx in (0, 15) or sr_idx == 3:  # reserved / not Layer III / free format
        return None
    mpeg1 = version == 3
    rate = _MP3_RATES[version][sr_idx]
    kbps = _MP3_BITRATES[mpeg1][br_idx]
    size = (144 if mpeg1 else 72) * kbps * 1000 // rate + pad
    return size, 1152 if mpeg1 else 576, rate


class Mp3Meter:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.buf = bytearray()
        self.samples = 0
        self.rate = 0
        self.started = False  # past a leading ID3v2 tag

    def feed(self, data: bytes) -> float:
        buf = self.buf
        buf += data
        if not self.started:
            if len(buf) < 10:
                return self.seconds
            if buf[:3] == b"ID3":  # syncsafe size, after the 10-byte header
                size = 10 + ((buf[6] << 21) | (buf[7] << 14) | (buf[8] << 7) | buf[9])
                if len(buf) < size:
                    return self.seconds
                del buf[:size]
            self.started = True
        i, n = 0, len(buf)
        while i + 4 <= n:
            frame = mp3_frame(buf, i)
            if frame is None:  # lost sync: the next 0xFF
                j = buf.find(b"\xff", i + 1)
                i = n if j < 0 else j
                continue
            size, samples, rate = frame
            if i + size > n:
                break
            self.samples += samples
            self.rate = rate
            i += size
        del buf[:i]
        if self.rate:
            self.seconds = self.samples / self.rate
        return self.seconds


class OggOpusMeter:
    """Ogg pages; audio = the last complete page's granule position (48 kHz) - OpusHead's pre-skip."""

    RATE = 48_000

    def __init__(self) -> None:
        self.seconds = 0.0
        self.buf = bytearray()
        self.pre_skip = 0

    def feed(self, data: bytes) -> float:
        buf = self.buf
        buf += data
        i, n = 0, len(buf)
        while n - i >= 27:
            if buf[i:i + 4] != b"OggS":
                j = buf.find(b"OggS", i + 1)
                i = n if j < 0 else j
                continue
            nsegs = buf[i + 26]
            if n - i < 27 + nsegs:
                break
            body = sum(buf[i + 27:i + 27 + nsegs])
            end = i + 27 + nsegs + body
            if end > n:
                break
            start = i + 27 + nsegs
            if buf[start:start + 8] == b"OpusHead":
                self.pre_skip = struct.unpack_from("<H", buf, start + 10)[0]
            granule = struct.unpack_from("<q", buf, i + 6)[0]
            if granule > 0:
                self.seconds = max(0, granule - self.pre_skip) / self.RATE
            i = end
        del buf[:i]
        return self.seconds


METERS = {"pcm": PcmMeter, "wav": WavMeter, "mp3": Mp3Meter, "opus": OggOpusMeter}
Meter = PcmMeter | WavMeter | Mp3Meter | OggOpusMeter


def make_meter(fmt: str) -> Meter:
    try:
        return METERS[fmt]()
    except KeyError:
        raise ValueError(f"no meter for format {fmt!r}; expected one of {', '.join(METERS)}") from None
