"""mp3 and opus through their libraries called directly (audio/lame.py, audio/opus.py) against the libav
path they replace (encoders.Mp3Encoder / OpusEncoder): the same decoded length and quality, streaming
bytes on every write, exact Ogg framing (CRC, granule positions, pre-skip), and the libav fallback."""
from __future__ import annotations

import gc
import io
import struct

import av
import numpy as np
import pytest

from csmserve.audio import encoders
from csmserve.audio.encoders import Mp3Encoder, OpusEncoder, encoder_class, make_encoder
from csmserve.audio.lame import LameEncoder
from csmserve.audio.opus import LibopusEncoder, OggPages, ogg_crc

SR = 24_000
pytestmark = pytest.mark.skipif(encoder_class("mp3", True) is Mp3Encoder or encoder_class("opus", True) is OpusEncoder,
                                reason="libmp3lame / libopus not loadable here")


def speechlike(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    phase = 2 * np.pi * np.cumsum(120 + 25 * np.sin(2 * np.pi * 0.5 * t)) / SR
    tone = sum(np.sin(k * phase) / k for k in range(1, 12))
    env = 0.3 + 0.7 * np.sin(2 * np.pi * 3.5 * t) ** 2
    return (0.3 * tone * env / np.abs(tone).max()).astype(np.float32)


def encode(fmt: str, pcm: np.ndarray, native: bool, chunk: int = 3840, **kw) -> tuple[list[bytes], bytes]:
    enc = make_encoder(fmt, native=native, **kw)
    parts = [enc.write(pcm[i:i + chunk]) for i in range(0, pcm.size, chunk)]
    return parts, enc.close()


def decode_24k(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(c.streams.audio[0]))
    r = av.AudioResampler(format="flt", layout="mono", rate=SR)
    out = [g.to_ndarray().reshape(-1) for f in frames for g in r.resample(f)]
    return np.concatenate(out + [g.to_ndarray().reshape(-1) for g in r.resample(None)])


def snr_db(ref: np.ndarray, y: np.ndarray, max_lag: int = 2000) -> float:
    """The best SNR over alignments of y against ref (codec delay)."""
    best = -np.inf
    for lag in range(max_lag):
        seg = y[lag:lag + ref.size]
        if seg.size < ref.size:
            break
        best = max(best, 10 * np.log10(np.sum(ref ** 2) / np.sum((ref - seg) ** 2)))
    return best


def test_the_native_classes_are_the_default_and_libav_stays_one_switch_away(monkeypatch):
    assert encoder_class("mp3") is LameEncoder and encoder_class("opus") is LibopusEncoder
    assert encoder_class("mp3", native=False) is Mp3Encoder and encoder_class("opus", native=False) is OpusEncoder
    monkeypatch.setenv("CSMSERVE_NATIVE_CODECS", "0")
    assert type(make_encoder("mp3")) is Mp3Encoder and type(make_encoder("opus")) is OpusEncoder
    assert encoder_class("flac") is encoders.FlacEncoder


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_same_length_and_quality_as_libav(fmt):
    pcm = speechlike(2.0)
    got = {}
    for native in (False, True):
        parts, tail = encode(fmt, pcm, native)
        assert parts[0] and all(parts[1:]), [len(p) for p in parts]  # bytes leave on every write
        audio = decode_24k(b"".join(parts) + tail)
        got[native] = (audio.size, snr_db(pcm[:SR], audio))
    if fmt == "opus":
        assert got[True][0] == pcm.size  # pre-skip and the end granule trim exactly
    else:
        assert got[True][0] == got[False][0]  # LAME's delay + padding, as libav's stream
    assert got[True][1] > 15 and got[True][1] >= got[False][1] - 1.0, got


def test_opus_pages_are_valid_ogg_with_exact_granules():
    pcm = speechlike(1.0)
    parts, tail = encode("opus", pcm, True)
    data = b"".join(parts) + tail
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        flags, granule, serial, seq, crc, nseg = struct.unpack_from("<BqIIIB", data, pos + 5)
        lacing = data[pos + 27:pos + 27 + nseg]
        end = pos + 27 + nseg + sum(lacing)
        page = data[pos:end]
        assert ogg_crc(page[:22] + b"\0\0\0\0" + page[26:]) == crc
        pages.append((flags, granule, seq, page[27 + nseg:]))
        pos = end
    assert [p[2] for p in pages] == list(range(len(pages)))
    assert pages[0][0] == OggPages.BOS and pages[0][3].startswith(b"OpusHead")
    assert pages[1][3].startswith(b"OpusTags") and pages[-1][0] == OggPages.EOS
    pre_skip = struct.unpack_from("<H", pages[0][3], 10)[0]
    assert pages[-1][1] == pre_skip + 2 * pcm.size  # 48 kHz units
    data_granules = [p[1] for p in pages[2:-1]]
    assert data_granules == sorted(data_granules) and all(g % 960 == 0 for g in data_granules)


def test_ogg_crc_is_the_msb_first_crc32_of_the_spec():
    def by_table(data: bytes) -> int:
        crc = 0
        for b in data:
            crc ^= b << 24
            for _ in range(8):
                crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
        return crc

    rng = np.random.default_rng(0)
    for n in (0, 1, 27, 300, 4096):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert ogg_crc(data) == by_table(data)


def test_a_long_write_splits_into_pages_of_at_most_255_segments():
    pcm = speechlike(12.0)  # 600 packets in one write: more than one page's 255 lacing values
    enc = make_encoder("opus", native=True)
    data = enc.write(pcm) + enc.close()
    assert data.count(b"OggS") >= 5
    assert decode_24k(data).size == pcm.size


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_options_short_streams_and_bad_arguments(fmt):
    pcm = speechlike(0.5)
    levels = ("0", "9") if fmt == "mp3" else ("0", "10")
    outs = {lv: b"".join(encode(fmt, pcm, True, codec_options={"compression_level": lv})[0]) for lv in levels}
    assert outs[levels[0]] != outs[levels[1]]  # the level reaches the codec
    with pytest.raises(ValueError):
        make_encoder(fmt, native=True, codec_options={"bogus": "1"})
    with pytest.raises(ValueError):
        make_encoder(fmt, native=True, codec_options={"compression_level": "11"})
    enc = make_encoder(fmt, native=True)
    assert decode_24k(enc.write(pcm[:100]) + enc.close()).size >= 100  # under one codec frame
    assert make_encoder(fmt, native=True).close()  # no audio: still a stream a decoder opens
    enc = make_encoder(fmt, native=True, speed=1.5)
    parts = [enc.write(pcm[i:i + 1920]) for i in range(0, pcm.size, 1920)]
    assert abs(decode_24k(b"".join(parts) + enc.close()).size - pcm.size / 1.5) < 0.1 * SR


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_the_library_state_is_freed_closed_or_dropped(fmt):
    enc = make_encoder(fmt, native=True)
    enc.write(speechlike(0.2))
    enc.close()
    assert not enc._free.alive
    dropped = make_encoder(fmt, native=True)
    dropped.write(speechlike(0.2))
    free = dropped._free
    del dropped  # a client gone mid-stream: the encoder is never closed
    gc.collect()
    assert not free.alive
