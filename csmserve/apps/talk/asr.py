"""talk's speech recognition: an OpenAI-compatible /v1/audio/transcriptions endpoint."""
from __future__ import annotations

from csmserve.apps.common import bearer, endpoint, error_message
from csmserve.apps.talk.errors import TalkError, endpoint_error


def transcribe(url: str, wav: bytes, model: str = "whisper-1", timeout: float = 60.0,
               api_key: str | None = None) -> str:
    """POST the audio to an OpenAI-compatible /v1/audio/transcriptions (multipart) -> the text."""
    import httpx

    full = endpoint(url, "/audio/transcriptions")
    try:
        r = httpx.post(full, files={"file": ("speech.wav", wav, "audio/wav")},
                       data={"model": model, "response_format": "json"}, headers=bearer(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise endpoint_error("ASR", full, e) from None
    if r.status_code != 200:
        raise TalkError(f"ASR endpoint {full} failed: HTTP {r.status_code}: {error_message(r.content)}")
    try:
        body = r.json()
        text = body["text"] if isinstance(body, dict) else str(body)
    except (ValueError, KeyError):
        text = r.text  # response_format=text servers
    return " ".join(str(text).split())
