"""What the commands (`csmserve speak`, `csmserve talk`) share: the one-line user-facing error, a URL
flag's check and forms, an HTTP error body's message, and audio clips read and written.

Imports nothing heavy (no torch, no server): `csmserve --help` loads it.
"""
from __future__ import annotations

import json

import numpy as np

from csmserve.config import SAMPLE_RATE
from csmserve.integrations import conversation

MAX_CLIP_SECONDS = 120  # an audio file given to speak or talk (read_clip)


# ---------------------------------------------------------------- errors
class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def one_line(e: BaseException) -> str:
    """An error's whole message on one line (a hint after the first line is kept)."""
    return " ".join(str(e).split()) or type(e).__name__


def error_message(body: bytes) -> str:
    """An HTTP error response's message: an OpenAI `{"error": {"message": ...}}` body's message (also
    `{"error": "..."}` and FastAPI's `{"detail": ...}`), else the first 200 bytes of the body."""
    try:
        err = json.loads(body)
    except ValueError:
        err = None
    if isinstance(err, dict):
        e = err.get("error", err.get("detail", err))
        if isinstance(e, dict):
            e = e.get("message", e)
        return str(e)
    return body[:200].decode("utf-8", "replace").strip() or "no body"


# ---------------------------------------------------------------- URLs
def check_url(flag: str, url: str | None) -> None:
    """CLIError unless `url` (the value of `flag`; None: not given) is an http:// or https:// URL."""
    if url is not None and not url.startswith(("http://", "https://")):
        raise CLIError(f"{flag} must start with http:// or https://, got {url!r}")


def base_url(url: str) -> str:
    """A server's URL as given (http://host:port, with a trailing / or /v1) -> http://host:port."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def endpoint(url: str, path: str) -> str:
    """A base URL (http://host:port, .../v1) or the full endpoint -> the full endpoint URL (`path` under /v1)."""
    url = url.rstrip("/")
    return url if url.endswith(path) else base_url(url) + "/v1" + path


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header for an API key ({} without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---------------------------------------------------------------- audio clips
def read_clip(data: bytes, name: str) -> np.ndarray:
    """Any common audio file's bytes -> [n] float32 at 24 kHz (CLIError `name: why` if it is not audio)."""
    from csmserve.audio import AudioDecodeError, decode_audio_24k

    try:
        return decode_audio_24k(data, max_seconds=MAX_CLIP_SECONDS)
    except AudioDecodeError as e:
        raise CLIError(f"{name}: {e}") from None


def pcm16(pcm: np.ndarray) -> bytes:
    """[n] float PCM -> s16le bytes (clipped to [-1, 1], scaled by 32767)."""
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def from_pcm16(data: bytes) -> np.ndarray:
    """s16le bytes -> [n] float32 PCM (scaled by 1/32767)."""
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def wav_bytes(pcm: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    """[n] float PCM -> a whole 16-bit mono WAV file."""
    return conversation.wav_bytes(pcm16(pcm), rate)


# SamplingParams' field -> the flag that sets it (its check's messages start with the field's name)
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                  "max_segment_length_ms": "--max-audio-length-ms"}


def check_sampling(args) -> None:
    """SamplingParams' own check of the sampling flags, its message naming the flag
    (`--top-p must be in (0, 1], got 0.0`), for speak and talk. --max-audio-length-ms caps each sentence."""
    from csmserve.sampling import SamplingParams

    try:
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=getattr(args, "top_p", 1.0), seed=args.seed,
                       max_audio_length_ms=None, max_segment_length_ms=args.max_audio_length_ms)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise CLIError(f"{SAMPLING_FLAGS.get(field, field)} {rest}") from None
