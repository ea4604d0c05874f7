"""The load benchmark's audio meters (csmserve/apps/bench/serve/meters.py) on our own encoders' output: the audio
counted at the end equals the decoded duration within one codec frame, however the bytes are split, and
audio counts as soon as the server's write that carries it has arrived."""
import io

import av
import numpy as np
import pytest

from csmserve.audio.encoders import make_encoder
from csmserve.apps.bench.serve.meters import PcmMeter, make_meter, mp3_frame

RATE = 24_000
FRAME_S = {"pcm": 1 / RATE, "wav": 1 / RATE, "mp3": 576 / RATE, "opus": 0.02}
FORMATS = tuple(FRAME_S)


def encoded(fmt: str, seconds: float, chunk: int, seed: int = 0) -> list[bytes]:
    """Noise (what the dummy model serves) through make_encoder in `chunk`-sample writes -> each write's bytes."""
    pcm = (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.2).astype(np.float32)
    enc = make_encoder(fmt, RATE)
    parts = [enc.write(pcm[i:i + chunk]) for i in range(0, pcm.size, chunk)]
    return parts + [enc.close()]


def decoded_seconds(data: bytes, fmt: str) -> float:
    if fmt == "pcm":
        return len(data) // 2 / RATE
    samples, rate = 0, None
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(c.streams.audio[0]):
            samples, rate = samples + frame.samples, frame.sample_rate
    return samples / rate


def random_pieces(data: bytes, rng: np.random.Generator) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        k = int(rng.choice([1, 2, 3, 7, 64, 500, 1500, 6000]))
        out.append(data[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("chunk", [1920, 7680])  # the server's first chunk (80 ms) and later ones (320 ms)
def test_counted_equals_decoded(fmt, chunk):
    parts = encoded(fmt, 2.5 + 123 / RATE, chunk)
    data = b"".join(parts)
    truth = decoded_seconds(data, fmt)
    for seed in range(3):
        meter = make_meter(fmt)
        seen = [meter.feed(p) for p in random_pieces(data, np.random.default_rng(seed))]
        end = meter.seconds
        assert abs(end - truth) <= FRAME_S[fmt] + 1e-9, (fmt, end, truth)
        assert all(a <= b for a, b in zip(seen, seen[1:])) and seen[-1] <= end
    whole = make_meter(fmt)
    whole.feed(data)
    assert abs(whole.seconds - truth) <= FRAME_S[fmt] + 1e-9


@pytest.mark.parametrize("fmt", FORMATS)
def test_audio_counts_when_its_write_arrives(fmt):
    """After the bytes of the k-th 80 ms write, the meter holds that write's audio less the codec's delay
    (mp3/opus hold back up to a frame or two), never more than was written."""
    parts = encoded(fmt, 1.0, 1920)
    meter = make_meter(fmt)
    delay = {"mp3": 0.08, "opus": 0.03}.get(fmt, 0.0)
    for k, part in enumerate(parts[:-1], 1):
        seconds, written = meter.feed(part), min(k * 0.08, 1.0)
        assert written - delay - FRAME_S[fmt] - 1e-9 <= seconds <= written + 1e-9, (fmt, k, seconds)
    assert make_meter(fmt).feed(parts[0]) > 0


def test_pcm_odd_bytes_and_wav_header_split():
    m = PcmMeter()
    assert m.feed(b"\x00" * 47_999) == pytest.approx(47_998 / 48_000)
    assert m.feed(b"\x00") == pytest.approx(1.0)
    wav = b"".join(encoded("wav", 0.5, 1920))
    meter = make_meter("wav")
    for b in wav[:50]:  # the 44-byte header a byte at a time
        meter.feed(bytes([b]))
    assert meter.feed(wav[50:]) == pytest.approx(0.5)


def test_mp3_skips_id3_and_garbage():
    frames = b"".join(encoded("mp3", 1.0, 1920))
    truth = make_meter("mp3")
    truth.feed(frames)
    tag = b"ID3\x04\x00\x00\x00\x00\x00\x0a" + b"\x00" * 10
    m = make_meter("mp3")
    m.feed(tag + b"\x00\x01junk" + frames[:100])
    m.feed(frames[100:])
    assert m.seconds == truth.seconds
    assert mp3_frame(frames, 0) == (192 + (frames[2] >> 1 & 1), 576, 24_000)  # 64 kbit/s MPEG-2 Layer III


def test_unknown_format():
    with pytest.raises(ValueError, match="no meter"):
        make_meter("flac")
