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


# ---- hostile uploads (issue 13): every one decodes or raises AudioDecodeError; none takes the process down
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from audio_files import raw_wav  # noqa: E402

_CHANNEL_CASES = [{"channels": c} for c in range(1, 17)] + [
    {"channels": 24}, {"channels": 64},
    {"channels": 8, "extensible": True, "mask": 0x63F},  # 7.1
    {"channels": 3, "extensible": True, "mask": 0x7},  # 3.0
    {"channels": 6, "extensible": True, "mask": 0x3},  # a mask naming fewer channels than there are
    {"channels": 16, "extensible": True, "mask": 0},  # no positions
    {"channels": 9, "bits": 32, "float_": True},
    {"channels": 12, "bits": 8},
]


def opus_71() -> bytes:
    """Opus 7.1: it decodes to planar float of 8 channels."""
    buf = io.BytesIO()
    x = (0.3 * np.sin(np.arange(960 * 25) / 10) * 32767).astype(np.int16)
    with av.open(buf, "w", format="ogg") as c:
        s = c.add_stream("libopus", rate=48_000)
        s.layout = "7.1"
        for i in range(25):
            frame = av.AudioFrame.from_ndarray(np.repeat(x[i * 960:(i + 1) * 960, None], 8, 1).reshape(1, -1),
                                               format="s16", layout="7.1")
            frame.sample_rate, frame.pts = 48_000, i * 960
            c.mux(s.encode(frame))
        c.mux(s.encode(None))
    return buf.getvalue()


def test_any_channel_count_decodes_in_a_child_process(tmp_path):
    """8+ channels crashed PyAV (SIGSEGV in to_ndarray on planar frames): decoded in a child, so a crash
    fails this test rather than pytest. Each WAV is 1 s of a 0.3 tone in every channel (averaged: 0.3)."""
    files = []
    for i, kw in enumerate(_CHANNEL_CASES):
        files.append(tmp_path / f"{i}.wav")
        files[-1].write_bytes(raw_wav(**kw))
    files.append(tmp_path / "71.opus")
    files[-1].write_bytes(opus_71())
    code = ("import json, sys, numpy as np; from csmserve.audio import decode_audio\n"
            "out = []\n"
            "for f in sys.argv[1:]:\n"
            "    pcm, sr = decode_audio(open(f, 'rb').read())\n"
            "    out.append([pcm.size, sr, float(abs(pcm).max()), bool(np.isfinite(pcm).all())])\n"
            "print(json.dumps(out))")
    r = subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(Path(__file__).parents[2]), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = json.loads(r.stdout)
    for kw, (n, sr, peak, finite) in zip(_CHANNEL_CASES, out):
        assert (n, sr) == (24_000, 24_000) and abs(peak - 0.3) < 0.01, (kw, n, sr, peak)
    n, sr, peak, finite = out[-1]
    assert sr == 48_000 and n > 20_000 and finite and 0.2 < peak < 0.4


@pytest.mark.parametrize("kw, match", [
    ({"bits": 32, "float_": True, "data": np.full((2400, 1), np.nan)}, "NaN or infinite"),
    ({"bits": 32, "float_": True, "data": np.full((2400, 2), np.inf)}, "NaN or infinite"),
    ({"bits": 64, "float_": True, "data": np.array([[0.1], [np.nan]] * 1200)}, "NaN or infinite"),
    ({"rate": 1, "samples": 30}, "sample rate"),
    ({"rate": 2**31 - 1, "samples": 1000}, "sample rate"),  # libav accepts it; the resampler ran out of memory
    ({"rate": 3_999}, "sample rate"),
    ({"samples": 0}, "no audio samples"),
])
def test_refused_audio(kw, match):
    with pytest.raises(AudioDecodeError, match=match):
        decode_audio(raw_wav(**kw))


def test_odd_but_valid_audio():
    assert decode_audio(raw_wav(samples=1))[0].size == 1
    assert decode_audio(raw_wav(rate=384_000, samples=384_000))[1] == 384_000
    assert decode_audio(raw_wav(rate=4_000, samples=400))[1] == 4_000
    loud, _ = decode_audio(raw_wav(bits=32, float_=True, data=np.full((100, 1), 1e30)))
    assert loud.max() == 1.0  # finite float samples beyond full scale are clipped


@pytest.mark.parametrize("cut", [0, 12, 36, 44, 45, 100, 47_000])
def test_truncated_wav(cut):
    data = raw_wav(channels=2)[:cut]
    try:
        pcm, _ = decode_audio(data)
        assert np.isfinite(pcm).all()
    except AudioDecodeError:
        pass
