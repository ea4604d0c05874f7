"""Reading uploaded audio (reference clips, context turns) of any common container/codec."""
from __future__ import annotations

import io

import av
import numpy as np

# rates a clip may have: telephone audio and up; past 768 kHz no real recording, only a header meant to
# make the resampler allocate (2^31 Hz -> MemoryError)
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4_000, 768_000


class AudioDecodeError(ValueError):
    """The bytes are not audio libav can read (or hold no samples, or samples that are not finite)."""


class AudioTooLongError(AudioDecodeError):
    """The audio is longer than the caller's limit."""


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """wav/mp3/flac/ogg/opus/m4a/aac/webm... bytes -> ([n] float32 mono in [-1, 1], native sample rate).

    Any number of channels, averaged. With max_seconds, decoding stops (AudioTooLongError) as soon as
    the limit is passed, so a small compressed upload cannot expand into unbounded PCM. NaN / inf
    samples and rates outside MIN_SAMPLE_RATE..MAX_SAMPLE_RATE are an AudioDecodeError."""
    if not data:
        raise AudioDecodeError("empty audio file")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioDecodeError("file has no audio stream")
            return _decode_stream(container, container.streams.audio[0], max_seconds)
    except AudioDecodeError:
        raise
    except av.FFmpegError as e:
        raise AudioDecodeError(f"could not decode audio: {e.strerror or e}") from e
    except (ValueError, MemoryError, OverflowError, IndexError) as e:  # PyAV on headers libav accepted
        raise AudioDecodeError(f"could not decode audio ({type(e).__name__})") from e


def _decode_stream(container, stream, max_seconds: float | None) -> tuple[np.ndarray, int]:
    # packed float32 whatever the decoder gives: one plane. Never to_ndarray() a planar frame of 8+
    # channels: PyAV 18 reads past its 8 data pointers there (SIGSEGV)
    to_packed: av.AudioResampler | None = None
    chunks: list[np.ndarray] = []  # each [n_i] float32 mono
    num, rate = 0, 0
    for frame in container.decode(stream):
        if to_packed is None:
            rate = frame.sample_rate
            if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
                raise AudioDecodeError(f"sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz")
            to_packed = av.AudioResampler(format="flt", rate=rate)  # later frames at another rate: converted
        for f in to_packed.resample(frame):
            chunks.append(_mono(f))
            num += chunks[-1].size
        if max_seconds is not None and num > max_seconds * rate:
            raise AudioTooLongError(f"audio is longer than {max_seconds:g} s")
    if to_packed is not None:
        chunks += [_mono(f) for f in to_packed.resample(None)]
        num = sum(c.size for c in chunks)
    if num == 0:
        raise AudioDecodeError("file contains no audio samples")
    pcm = np.concatenate(chunks)
    if not np.isfinite(pcm).all():
        raise AudioDecodeError("audio has NaN or infinite samples")
    return np.clip(pcm, -1.0, 1.0, out=pcm), rate  # float files may hold any finite value


def _mono(frame: av.AudioFrame) -> np.ndarray:
    x = frame.to_ndarray()  # [1, n * C] interleaved
    with np.errstate(all="ignore"):  # float samples near 3e38 sum to inf: refused as not finite
        return x.reshape(frame.samples, -1).mean(axis=1, dtype=np.float32) if frame.samples else x.reshape(0)


def duration_s(pcm: np.ndarray, sample_rate: int) -> float:
    return pcm.shape[-1] / sample_rate


def check_duration(pcm: np.ndarray, sample_rate: int, max_seconds: float, min_seconds: float = 0.0) -> float:
    """Return the clip's duration in seconds, or raise AudioDecodeError/AudioTooLongError outside the range."""
    seconds = duration_s(pcm, sample_rate)
    if seconds > max_seconds:
        raise AudioTooLongError(f"audio is {seconds:.2f} s; the limit is {max_seconds:g} s")
    if seconds < min_seconds:
        raise AudioDecodeError(f"audio is {seconds:.2f} s; at least {min_seconds:g} s is needed")
    return seconds


def decode_audio_24k(data: bytes, max_seconds: float | None = None) -> np.ndarray:
    """Any common audio file's bytes -> [n] float32 mono at 24 kHz (the rate Mimi encodes)."""
    from csmserve.audio.resample import resample

    pcm, rate = decode_audio(data, max_seconds)
    return pcm if rate == 24000 else resample(pcm, rate, 24000)
