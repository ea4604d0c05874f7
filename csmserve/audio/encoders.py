"""Streaming encoders: float32 PCM chunks (mono) -> bytes ready for the wire, one class per format.

    enc = make_encoder("mp3", sample_rate=24000, speed=1.0)
    for chunk in chunks:            # [n] float32 in [-1, 1], any n (engine chunks are n * 1920)
        send(enc.write(chunk))      # may be b"" while the codec fills its first frame
    send(enc.close())               # codec tail; the stream is complete after this

Every format streams: bytes leave on write(), not only at close(). Output is never seeked back into (the muxers
see a non-seekable sink), so the bytes sent first are final: no Xing/Info frame in mp3, sizes 0xFFFFFFFF in the
wav header, no sample count or MD5 in the FLAC STREAMINFO. First bytes, counted in 1920-sample (80 ms) chunks at
24 kHz: pcm, wav, opus, flac, mp3: the 1st write; aac: the 2nd (1024-sample priming + look-ahead). speed != 1
adds about one chunk of lag (atempo's analysis window).

mp3 and opus default to their libraries called directly (audio/lame.py, audio/opus.py: the same codec settings,
~25-40% less CPU per stream); Mp3Encoder and OpusEncoder here are the libav path, used where those libraries do
not load or with CSMSERVE_NATIVE_CODECS=0.
"""
from __future__ import annotations

import os
import struct
from functools import cache
from typing import ClassVar

import av
import numpy as np

from csmserve.audio import lame, opus
from csmserve.audio.base import Encoder
from csmserve.audio.libs import native
from csmserve.audio.tempo import av_frame
from csmserve.config import SAMPLE_RATE


def to_s16le(pcm: np.ndarray) -> bytes:
    # [n] float32 -> 2n bytes; 32767 scale so +1.0 does not wrap and q/32767 round-trips exactly
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class PcmEncoder(Encoder):
    """Raw s16le mono, no header (OpenAI `pcm`: 24 kHz)."""

    format, media_type = "pcm", "audio/pcm"

    def _encode(self, pcm: np.ndarray) -> bytes:
        return to_s16le(pcm)


def wav_header(sample_rate: int, data_size: int = 0xFFFFFFFF) -> bytes:
    # 44-byte canonical header, 16-bit PCM mono; 0xFFFFFFFF = "unknown, read to EOF" (streaming)
    riff_size = 0xFFFFFFFF if data_size == 0xFFFFFFFF else 36 + data_size
    return struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", riff_size, b"WAVE", b"fmt ", 16,
                       1, 1, sample_rate, 2 * sample_rate, 2, 16,  # PCM, mono, rate, bytes/s, align, bits
                       b"data", data_size)


class WavEncoder(PcmEncoder):
    """Streaming WAV: header with RIFF and data sizes 0xFFFFFFFF, then s16le samples."""

    format, media_type = "wav", "audio/wav"

    def __init__(self, sample_rate: int = SAMPLE_RATE, speed: float = 1.0) -> None:
        super().__init__(sample_rate, speed)
        self.header: bytes | None = wav_header(sample_rate)  # sent with the first bytes

    def _encode(self, pcm: np.ndarray) -> bytes:
        return self._take_header() + to_s16le(pcm)

    def _finish(self) -> bytes:
        return self._take_header()  # an empty stream is still a valid (empty) wav

    def _take_header(self) -> bytes:
        header, self.header = self.header or b"", None
        return header


class _Sink:
    """Write-only file object for libav: no seek(), so muxers never rewrite earlier bytes."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def seekable(self) -> bool:
        return False

    def drain(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


@cache
def single_threaded_libav() -> None:
    """Every libav object of this process uses one thread. PyAV re-blocks audio for the codec through a
    libavfilter graph that otherwise starts a thread per core per encoder (~3,900 threads for 256 mp3
    streams on 16 cores); the codec's own thread_count does not reach it. Streams spread over the API
    worker processes instead."""
    lib = native("avutil")
    if lib is not None and hasattr(lib, "av_cpu_force_count"):  # else a libav without it: its default threads
        lib.av_cpu_force_count(1)


class AvEncoder(Encoder):
    """A libav codec in a libav muxer, writing into a `_Sink` drained after every write."""

    container: ClassVar[str]
    codec: ClassVar[str]
    heavy = True
    bit_rate: ClassVar[int | None] = None
    container_options: ClassVar[dict[str, str]] = {}
    codec_options: ClassVar[dict[str, str]] = {}

    def __init__(self, sample_rate: int = SAMPLE_RATE, speed: float = 1.0,
                 codec_options: dict[str, str] | None = None) -> None:
        super().__init__(sample_rate, speed)
        single_threaded_libav()
        self.sink = _Sink()
        # flush_packets: push every muxed packet through avio to the sink at once
        options = {"flush_packets": "1", **self.container_options}
        self.out = av.open(self.sink, mode="w", format=self.container, options=options)
        # the codec's rate if it takes ours (24 kHz: all four do), else its highest (PyAV resamples)
        rates = av.codec.Codec(self.codec, "w").audio_rates
        rate = sample_rate if not rates or sample_rate in rates else max(rates)
        self.stream = self.out.add_stream(self.codec, rate=rate,
                                          options={**self.codec_options, **(codec_options or {})})
        self.stream.layout = "mono"
        self.stream.codec_context.thread_count = 1  # libav's default is one per core (single_threaded_libav)
        self.stream.codec_context.thread_type = "NONE"
        if self.bit_rate:
            self.stream.bit_rate = self.bit_rate
        self.num_samples = 0  # pts of the next input frame, in 1/sample_rate

    def _encode(self, pcm: np.ndarray) -> bytes:
        # PyAV converts format/rate and re-blocks to the codec's frame size (1152, 1024, 480...)
        self.out.mux(self.stream.encode(av_frame(pcm, self.sample_rate, self.num_samples)))
        self.num_samples += pcm.size
        return self.sink.drain()

    def _finish(self) -> bytes:
        self.out.mux(self.stream.encode(None))  # drain the codec's delay line
        self.out.close()  # trailer: last Ogg page, etc.
        return self.sink.drain()


class Mp3Encoder(AvEncoder):
    """MPEG-2 Layer III (24 kHz). No ID3 tag and no Xing/Info frame: a plain frame stream,
    so decoders see the encoder delay and padding (~1100 samples) as extra audio. LAME's quality 7 by
    default (--mp3-compression-level): 5.0 ms of CPU per second of audio against 8.6 at its default,
    for speech at 64 kb/s (docs/benchmarks.md)."""

    format, media_type = lame.FORMAT, lame.MEDIA_TYPE
    container, codec, bit_rate = "mp3", "libmp3lame", lame.BIT_RATE
    container_options = {"write_xing": "0", "id3v2_version": "0"}
    codec_options = {"compression_level": str(lame.QUALITY)}


class OpusEncoder(AvEncoder):
    """Ogg/Opus at 24 kHz in (libopus takes it directly; decoders output 48 kHz).
    page_duration 20 ms: one Ogg page per Opus packet, so pages leave every write."""

    format, media_type = opus.FORMAT, opus.MEDIA_TYPE
    container, codec, bit_rate = "ogg", "libopus", opus.BIT_RATE
    container_options = {"page_duration": "20000"}
    # complexity 5 (--opus-complexity): 2.8 ms of CPU per second of audio against 10 at libopus' 10
    codec_options = {"compression_level": str(opus.COMPLEXITY)}


class AacEncoder(AvEncoder):
    """AAC-LC in ADTS (self-framed, no container header)."""

    format, media_type = "aac", "audio/aac"
    container, codec, bit_rate = "adts", "aac", 64_000


class FlacEncoder(AvEncoder):
    """FLAC with 1920-sample blocks (one per 80 ms chunk); STREAMINFO leaves total samples
    and MD5 unset because the header is sent before the audio exists."""

    format, media_type = "flac", "audio/flac"
    container, codec = "flac", "flac"
    container_options = {"metadata_header_padding": "0"}  # default pads the header with 8 KiB
    codec_options = {"frame_size": "1920"}


ENCODERS: dict[str, type[Encoder]] = {
    cls.format: cls for cls in (Mp3Encoder, OpusEncoder, AacEncoder, FlacEncoder, WavEncoder, PcmEncoder)
}
FORMATS = tuple(ENCODERS)  # OpenAI's response_format values
MEDIA_TYPES = {name: cls.media_type for name, cls in ENCODERS.items()}


# fmt -> (its library loader: a CDLL or None, the encoder that calls it directly)
_DIRECT = {"mp3": (lame.library, lame.LameEncoder), "opus": (opus.library, opus.LibopusEncoder)}


def native_codecs() -> bool:
    """mp3 and opus through their libraries called directly (audio/lame.py, audio/opus.py), not libav;
    CSMSERVE_NATIVE_CODECS=0 keeps libav (the A/B in bench/encoder_cost.py and through the server)."""
    return os.environ.get("CSMSERVE_NATIVE_CODECS", "1") != "0"


def encoder_class(fmt: str, native: bool | None = None) -> type[Encoder]:
    """The class make_encoder(fmt) builds: for mp3 / opus the direct one where its library loads."""
    try:
        cls = ENCODERS[fmt]
    except KeyError:
        raise ValueError(f"unknown response_format {fmt!r}; expected one of {', '.join(FORMATS)}") from None
    direct = _DIRECT.get(fmt)
    if direct is not None and (native_codecs() if native is None else native) and direct[0]() is not None:
        return direct[1]
    return cls


def make_encoder(fmt: str, sample_rate: int = SAMPLE_RATE, speed: float = 1.0,
                 codec_options: dict[str, str] | None = None, native: bool | None = None) -> Encoder:
    """codec_options: libav options of the format's codec (e.g. {"compression_level": "9"}); pcm/wav none.
    native: mp3 / opus through their libraries directly (default: native_codecs()) or through libav."""
    cls = encoder_class(fmt, native)
    if issubclass(cls, PcmEncoder):  # pcm, wav: no codec
        return cls(sample_rate, speed)
    return cls(sample_rate, speed, codec_options)
