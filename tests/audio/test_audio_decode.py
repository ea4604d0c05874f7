import io

import av
import numpy as np
import pytest

from csmserve.audio import (AudioDecodeError, AudioTooLongError, check_duration, decode_audio,
                            make_encoder)


def write_file(fmt: str, codec: str, rate: int, seconds: float = 1.0, layout: str = "stereo") -> bytes:
    # a 440 Hz sine at 0.5 in every channel, written by libav the way a user's tool would
    buf = io.BytesIO()
    n = int(rate * seconds)
    channels = 2 if layout == "stereo" else 1
    x = np.repeat((0.5 * np.sin(2 * np.pi * 440 * np.arange(n) / rate))[None], channels, 0).astype(np.float32)
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = layout
        frame = av.AudioFrame.from_ndarray(x, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = rate, 0
        c.mux(s.encode(frame))
        c.mux(s.encode(None))
    return buf.getvalue()


CASES = [  # (container, codec, rate)
    ("wav", "pcm_s16le", 44_100),
    ("flac", "flac", 48_000),
    ("mp3", "libmp3lame", 44_100),
    ("ogg", "libopus", 48_000),
    ("ipod", "aac", 44_100),  # .m4a
    ("webm", "libopus", 48_000),
]


@pytest.mark.parametrize("fmt,codec,rate", CASES)
def test_decodes_common_formats_to_mono(fmt, codec, rate):
    pcm, sr = decode_audio(write_file(fmt, codec, rate))
    assert sr == rate and pcm.dtype == np.float32 and pcm.ndim == 1
    assert abs(pcm.size - rate) < 0.06 * rate  # codec delay/padding
    assert 0.45 < np.abs(pcm).max() < 0.55  # channels averaged, not summed


def test_decodes_our_own_streams():
    for fmt in ("mp3", "opus", "aac", "flac", "wav"):
        enc = make_encoder(fmt)
        data = enc.write(np.zeros(4 * 1920, np.float32)) + enc.close()
        pcm, sr = decode_audio(data)
        assert sr in (24_000, 48_000) and pcm.size > 0


@pytest.mark.parametrize("data", [
    b"",
    b"hello, this is not audio " * 50,
    np.random.default_rng(0).bytes(10_000),
    b"RIFF\xff\xff\xff\xffWAVEfmt ",
    b"\x89PNG\r\n\x1a\n" + bytes(200),
])
def test_garbage_raises_decode_error(data):
    with pytest.raises(AudioDecodeError):
        decode_audio(data)


def test_max_seconds_stops_early():
    data = write_file("wav", "pcm_s16le", 24_000, seconds=3.0, layout="mono")
    with pytest.raises(AudioTooLongError):
        decode_audio(data, max_seconds=1.0)
    assert decode_audio(data, max_seconds=5.0)[0].size == 72_000


def test_check_duration():
    pcm = np.zeros(48_000, np.float32)
    assert check_duration(pcm, 24_000, max_seconds=2.0) == 2.0
    with pytest.raises(AudioTooLongError):
        check_duration(pcm, 24_000, max_seconds=1.5)
    with pytest.raises(AudioDecodeError):
        check_duration(pcm, 24_000, max_seconds=10, min_seconds=3)
