"""Reading uploaded audio (reference clips, context turns) of any common container/codec."""
from __future__ import annotations

import io

import av
import numpy as np


class AudioDecodeError(ValueError):
    """The bytes are not audio libav can read (or hold no samples)."""


class AudioTooLongError(AudioDecodeError):
    """The audio is longer than the caller's limit."""


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """wav/mp3/flac/ogg/opus/m4a/aac/webm... bytes -> ([n] float32 mono in [-1, 1], native sample rate).

    Channels are averaged. With max_seconds, decoding stops (AudioTooLongError) as soon as the
    limit is passed, so a small compressed upload cannot expand into unbounded PCM."""
    if not data:
        raise AudioDecodeError("empty audio file")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise AudioDecodeError("file has no audio stream")
            return _decode_stream(container, container.streams.audio[0], max_seconds)
    except av.FFmpegError as e:
        raise AudioDecodeError(f"could not decode audio: {e.strerror or e}") from e


def _decode_stream(container, stream, max_seconds: float | None) -> tuple[np.ndarray, int]:
    to_planar = av.AudioResampler(format="fltp")  # keeps layout and rate; only the sample format
    chunks: list[np.ndarray] = []  # each [n_i] float32 mono
    num, rate = 0, 0
    for frame in container.decode(stream):
        rate = rate or frame.sample_rate
        for f in to_planar.resample(frame):
            chunks.append(f.to_ndarray().mean(axis=0, dtype=np.float32))  # [C, n] -> [n]
            num += chunks[-1].size
        if max_seconds is not None and num > max_seconds * rate:
            raise AudioTooLongError(f"audio is longer than {max_seconds:g} s")
    if num == 0:
        raise AudioDecodeError("file contains no audio samples")
    return np.concatenate(chunks), rate


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
