"""How much audio has arrived: bytes of a response body in, seconds of playable audio out, without decoding.

    meter = make_meter("mp3")
    for data in body:                # any split, a frame may straddle two pieces
        seconds = meter.feed(data)   # complete frames so far
    seconds = meter.finish()         # the stream ended: a trailing frame with no successor counts too

Each format is read from its framing alone:
  pcm   24 kHz s16le: bytes / 48,000
  wav   the RIFF chunks up to `data` (rate and sample size from `fmt `), then bytes
  mp3   MPEG audio frame headers (length from bitrate, rate and padding); MPEG-2 Layer III at 24 kHz
        is 576 samples a frame. An ID3v2 tag is skipped; a lost sync scans for the next frame.
  opus  Ogg pages: a page is complete once its segment table's bytes are in; the last complete
        page's granule position (48 kHz) less OpusHead's pre-skip
  aac   ADTS headers: frame length and raw data blocks (1,024 samples each) in the header
  flac  frame headers (sync 0xFFF8/9 with a valid CRC-8; block size in the header). A frame is
        complete when the next header arrives, or when the bytes so far end in the frame's own
        CRC-16 (checked incrementally, each byte once), so the frame that ends a write counts at once.
"""
from __future__ import annotations

import struct

PCM_RATE = 24_000


class Meter:
    """Base: `feed(bytes) -> seconds`, `finish() -> seconds`."""

    seconds: float = 0.0

    def feed(self, data: bytes) -> float:
        raise NotImplementedError

    def finish(self) -> float:
        return self.seconds


class PcmMeter(Meter):
    def __init__(self, rate: int = PCM_RATE, sample_bytes: int = 2) -> None:
        self.bytes_per_s = rate * sample_bytes
        self.sample_bytes = sample_bytes
        self.nbytes = 0

    def feed(self, data: bytes) -> float:
        self.nbytes += len(data)
        self.seconds = (self.nbytes - self.nbytes % self.sample_bytes) / self.bytes_per_s
        return self.seconds


class WavMeter(Meter):
    """RIFF/WAVE: chunks up to `data`, then PCM bytes (the streaming header's sizes are 0xFFFFFFFF)."""

    def __init__(self) -> None:
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


class Mp3Meter(Meter):
    def __init__(self) -> None:
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


class OggOpusMeter(Meter):
    """Ogg pages; audio = the last complete page's granule position (48 kHz) - OpusHead's pre-skip."""

    RATE = 48_000

    def __init__(self) -> None:
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


_AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)


class AdtsMeter(Meter):
    """AAC in ADTS: each header carries its frame's length; 1,024 samples per raw data block."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.samples = 0
        self.rate = 0

    def feed(self, data: bytes) -> float:
        buf = self.buf
        buf += data
        i, n = 0, len(buf)
        while n - i >= 7:
            if buf[i] != 0xFF or (buf[i + 1] & 0xF6) != 0xF0:  # sync 0xFFF, layer 0
                j = buf.find(b"\xff", i + 1)
                i = n if j < 0 else j
                continue
            sr_idx = (buf[i + 2] >> 2) & 0xF
            size = ((buf[i + 3] & 3) << 11) | (buf[i + 4] << 3) | (buf[i + 5] >> 5)
            if sr_idx >= len(_AAC_RATES) or size < 7:
                i += 1
                continue
            if i + size > n:
                break
            self.rate = _AAC_RATES[sr_idx]
            self.samples += 1024 * ((buf[i + 6] & 3) + 1)
            i += size
        del buf[:i]
        if self.rate:
            self.seconds = self.samples / self.rate
        return self.seconds


def _crc_table(poly: int, width: int) -> tuple[int, ...]:
    top, mask = 1 << (width - 1), (1 << width) - 1
    table = []
    for byte in range(256):
        crc = byte << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ poly) if crc & top else (crc << 1)
        table.append(crc & mask)
    return tuple(table)


_CRC8 = _crc_table(0x07, 8)  # FLAC frame header: x^8 + x^2 + x + 1
_CRC16 = _crc_table(0x8005, 16)  # FLAC frame: x^16 + x^15 + x^2 + 1
_FLAC_BLOCK = {1: 192, 2: 576, 3: 1152, 4: 2304, 5: 4608, **{c: 256 << (c - 8) for c in range(8, 16)}}
_FLAC_RATES = {1: 88200, 2: 176400, 3: 192000, 4: 8000, 5: 16000, 6: 22050, 7: 24000, 8: 32000, 9: 44100,
               10: 48000, 11: 96000}


def crc8(data, start: int, end: int) -> int:
    crc = 0
    for k in range(start, end):
        crc = _CRC8[crc ^ data[k]]
    return crc


def flac_frame_header(b: bytes | bytearray, i: int) -> tuple[int, int | None, int] | None:
    """The frame header at b[i:] -> (block size in samples, sample rate or None = STREAMINFO's, the coded
    number: the frame's index (fixed block size) or its first sample's (variable)); None if there is no
    valid header there (or not all of it has arrived)."""
    n = len(b)
    if n - i < 6 or b[i] != 0xFF or (b[i + 1] & 0xFE) != 0xF8:
        return None
    bs_code, sr_code = b[i + 2] >> 4, b[i + 2] & 0xF
    if bs_code == 0 or sr_code == 15 or (b[i + 3] >> 4) > 10 or b[i + 3] & 1:
        return None
    j = i + 4
    lead = b[j]  # the number, coded like UTF-8 in 1..7 bytes
    if lead < 0x80:
        extra, number = 0, lead
    else:
        extra = next((e for e, top in enumerate((0xE0, 0xF0, 0xF8, 0xFC, 0xFE, 0xFF), 1) if lead < top), -1)
        if lead < 0xC0 or extra < 0:
            return None
        number = lead & (0x3F >> extra)
    if n < j + 1 + extra:
        return None
    for k in range(j + 1, j + 1 + extra):
        if b[k] & 0xC0 != 0x80:
            return None
        number = (number << 6) | (b[k] & 0x3F)
    j += 1 + extra
    if bs_code in (6, 7):
        if n < j + bs_code - 5:
            return None
        block = (b[j] if bs_code == 6 else (b[j] << 8) | b[j + 1]) + 1
        j += bs_code - 5
    else:
        block = _FLAC_BLOCK[bs_code]
    rate = _FLAC_RATES.get(sr_code)
    if sr_code in (12, 13, 14):
        size = 1 if sr_code == 12 else 2
        if n < j + size:
            return None
        v = b[j] if size == 1 else (b[j] << 8) | b[j + 1]
        rate = v * 1000 if sr_code == 12 else v if sr_code == 13 else v * 10
        j += size
    if n < j + 1 or crc8(b, i, j) != b[j]:
        return None
    return block, rate, number


class FlacMeter(Meter):
    def __init__(self) -> None:
        self.buf = bytearray()  # from the current frame's first byte (after the metadata)
        self.in_metadata = True
        self.rate = 0
        self.samples = 0  # in frames known complete
        self.frames = 0
        self.block = 0  # the current frame's samples (0: no frame yet)
        self.scan = 2  # where the search for the next header resumes
        self.crc = 0  # CRC-16 of buf[:crc_pos]
        self.crc_pos = 0

    def feed(self, data: bytes) -> float:
        self.buf += data
        if self.in_metadata and not self._metadata():
            return self.seconds
        buf = self.buf
        if not self.block:
            header = flac_frame_header(buf, 0)
            if header is None:
                return self.seconds
            self._start_frame(header)
        # the current frame ends where the next valid header (numbered next in sequence) begins
        k = self.scan
        while (k := buf.find(b"\xff", k)) >= 0:
            header = flac_frame_header(buf, k)
            if header is None or header[2] not in (self.frames + 1, self.samples + self.block):
                if header is None and len(buf) - k < 16 and (k + 1 == len(buf) or buf[k + 1] & 0xFE == 0xF8):
                    break  # perhaps a header not all here yet
                k += 1
                continue
            self.samples += self.block
            self.frames += 1
            del buf[:k]
            self.crc, self.crc_pos, k = 0, 0, 2
            self._start_frame(header)
        self.scan = max(2, len(buf) if k < 0 else k)
        tail = self.block if self._ends_in_crc() else 0
        self.seconds = (self.samples + tail) / self.rate if self.rate else 0.0
        return self.seconds

    def finish(self) -> float:
        if self.block and self.rate:
            self.seconds = (self.samples + self.block) / self.rate
        return self.seconds

    def _start_frame(self, header: tuple[int, int | None, int]) -> None:
        self.block = header[0]
        self.rate = header[1] or self.rate

    def _ends_in_crc(self) -> bool:
        buf, end = self.buf, len(self.buf) - 2
        if end < 8:
            return False
        crc, table = self.crc, _CRC16
        for k in range(self.crc_pos, end):
            crc = ((crc << 8) & 0xFFFF) ^ table[(crc >> 8) ^ buf[k]]
        self.crc, self.crc_pos = crc, end
        return crc == (buf[end] << 8) | buf[end + 1]

    def _metadata(self) -> bool:
        """Skip `fLaC` and the metadata blocks (rate from STREAMINFO) -> True once past them."""
        buf, pos = self.buf, 4
        if len(buf) < 4:
            return False
        if buf[:4] != b"fLaC":
            raise ValueError("not a FLAC stream")
        while True:
            if len(buf) < pos + 4:
                return False
            last, kind = buf[pos] >> 7, buf[pos] & 0x7F
            size = int.from_bytes(buf[pos + 1:pos + 4], "big")
            if len(buf) < pos + 4 + size:
                return False
            if kind == 0:  # STREAMINFO: 20-bit sample rate at byte 10
                s = pos + 4
                self.rate = (buf[s + 10] << 12) | (buf[s + 11] << 4) | (buf[s + 12] >> 4)
            pos += 4 + size
            if last:
                del buf[:pos]
                self.in_metadata = False
                return True


METERS = {"pcm": PcmMeter, "wav": WavMeter, "mp3": Mp3Meter, "opus": OggOpusMeter, "aac": AdtsMeter,
          "flac": FlacMeter}


def make_meter(fmt: str) -> Meter:
    try:
        return METERS[fmt]()
    except KeyError:
        raise ValueError(f"no meter for format {fmt!r}; expected one of {', '.join(METERS)}") from None
