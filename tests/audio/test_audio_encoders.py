import io
import struct

import av
import numpy as np
import pytest

from csmserve.audio import FORMATS, MEDIA_TYPES, make_encoder

SR, CHUNK, N = 24_000, 1920, 10  # 10 Mimi frames = 800 ms

# decoded rate; (min, max) extra samples a decoder returns at that rate. mp3 (no Xing/LAME tag)
# and ADTS cannot carry gapless info, so lame's ~1105-sample delay / AAC's 1024 priming plus
# padding to a whole codec frame (576 / 1024) come back as audio; the others are exact.
DECODED = {
    "mp3": (24_000, 0, 1105 + 576),
    "aac": (24_000, 0, 1024 + 1024),
    "opus": (48_000, -960, 960),  # decoders output Opus at 48 kHz; pre-skip/end granule trim exactly
    "flac": (24_000, 0, 0),
    "wav": (24_000, 0, 0),
}
FIRST_BYTES_BY_CHUNK = {"pcm": 1, "wav": 1, "opus": 1, "flac": 1, "mp3": 1, "aac": 2}


def sine(n: int, hz: float = 440.0, sr: int = SR) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(n) / sr)).astype(np.float32)


def stream(fmt: str, pcm: np.ndarray, speed: float = 1.0) -> tuple[list[bytes], bytes]:
    enc = make_encoder(fmt, sample_rate=SR, speed=speed)
    parts = [enc.write(pcm[i:i + CHUNK]) for i in range(0, pcm.size, CHUNK)]
    return parts, enc.close()


def decode(data: bytes) -> tuple[np.ndarray, int, int]:
    # -> ([n] float32 first channel, rate, channels)
    with av.open(io.BytesIO(data)) as c:
        frames = [f for f in c.decode(c.streams.audio[0])]
    resampler = av.AudioResampler(format="fltp")
    pcm = np.concatenate([g.to_ndarray() for f in frames for g in resampler.resample(f)], axis=1)
    return pcm[0], frames[0].sample_rate, frames[0].layout.nb_channels


def peak_hz(pcm: np.ndarray, sr: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(pcm.size)))
    return float(np.argmax(spectrum) * sr / pcm.size)


def test_all_openai_formats_present():
    assert set(FORMATS) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    assert MEDIA_TYPES["mp3"] == "audio/mpeg"


@pytest.mark.parametrize("fmt", sorted(DECODED))
def test_streams_and_decodes(fmt):
    parts, tail = stream(fmt, sine(N * CHUNK))
    first = next(i for i, p in enumerate(parts) if p) + 1
    assert first <= FIRST_BYTES_BY_CHUNK[fmt], [len(p) for p in parts]
    assert sum(map(len, parts)) > len(tail)  # most bytes leave before close()
    pcm, rate, channels = decode(b"".join(parts) + tail)
    want_rate, lo, hi = DECODED[fmt]
    assert (rate, channels) == (want_rate, 1)
    expected = N * CHUNK * rate // SR
    assert lo <= pcm.size - expected <= hi, (pcm.size, expected)
    assert abs(peak_hz(pcm, rate) - 440) < 5


def test_pcm_exact_round_trip():
    q = np.random.default_rng(0).integers(-32767, 32768, N * CHUNK).astype(np.int16)
    parts, tail = stream("pcm", q.astype(np.float32) / 32767)
    assert all(len(p) == 2 * CHUNK for p in parts) and tail == b""
    assert np.array_equal(np.frombuffer(b"".join(parts), "<i2"), q)


def test_pcm_clips_instead_of_wrapping():
    out = make_encoder("pcm").write(np.array([2.0, -2.0, 1.0, -1.0], np.float32))
    assert np.frombuffer(out, "<i2").tolist() == [32767, -32767, 32767, -32767]


def test_wav_streaming_header():
    parts, tail = stream("wav", sine(N * CHUNK))
    data = b"".join(parts) + tail
    riff, riff_size, wave, fmt_id, fmt_size = struct.unpack("<4sI4s4sI", data[:20])
    tag, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", data[20:36])
    data_id, data_size = struct.unpack("<4sI", data[36:44])
    assert (riff, wave, fmt_id, data_id) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert riff_size == data_size == 0xFFFFFFFF  # unknown length: read to EOF
    assert (fmt_size, tag, channels, rate, byte_rate, align, bits) == (16, 1, 1, SR, 2 * SR, 2, 16)
    assert len(parts[0]) == 44 + 2 * CHUNK and len(data) == 44 + 2 * N * CHUNK


def test_empty_wav_is_a_header():
    assert len(make_encoder("wav").close()) == 44


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_speed_keeps_pitch_and_scales_duration(speed):
    """Exactly round(samples / speed) samples (atempo's own tail cut or padded): the length the timestamps and
    the usage say."""
    parts, tail = stream("wav", sine(N * CHUNK), speed=speed)
    pcm, rate, _ = decode(b"".join(parts) + tail)
    assert pcm.size == round(N * CHUNK / speed)
    assert abs(peak_hz(pcm, rate) - 440) < 10


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_speed_with_codecs(fmt):
    parts, tail = stream(fmt, sine(N * CHUNK), speed=2.0)
    assert any(parts)
    pcm, rate, _ = decode(b"".join(parts) + tail)
    assert abs(pcm.size / rate - 0.4) < 0.1


def test_bad_arguments():
    with pytest.raises(ValueError, match="response_format"):
        make_encoder("ogg")
    with pytest.raises(ValueError, match="speed"):
        make_encoder("mp3", speed=5.0)
    with pytest.raises(ValueError, match="mono"):
        make_encoder("pcm").write(np.zeros((2, 10), np.float32))


def test_accepts_row_vectors_and_rejects_writes_after_close():
    enc = make_encoder("pcm")
    assert len(enc.write(np.zeros((1, 10)))) == 20
    assert enc.close() == b"" and enc.close() == b""
    with pytest.raises(RuntimeError):
        enc.write(np.zeros(10, np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_close_without_audio_and_short_streams(fmt):
    make_encoder(fmt).close()  # a request that produced no audio must not raise
    enc = make_encoder(fmt)
    data = enc.write(sine(100)) + enc.close()  # less than one codec frame
    assert data
    if fmt != "pcm":
        assert decode(data)[0].size >= 100
