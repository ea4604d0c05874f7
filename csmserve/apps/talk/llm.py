"""talk's LLM: an OpenAI-compatible /v1/chat/completions endpoint, its reply streamed (server-sent events)."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from csmserve.apps.common import bearer, endpoint, error_message
from csmserve.apps.talk.errors import TalkError, endpoint_error

SYSTEM_PROMPT = ("You are a friendly voice assistant in a spoken conversation. Answer in one to three short "
                 "spoken sentences: no lists, no markdown, no emoji.")


@dataclass
class LLMStream:
    """The streamed chat completion: iterate for the content pieces; first_token_t (perf_counter) when the first came.
    Setting `stop` ends the iteration at the next line."""

    url: str
    model: str
    messages: list[dict]
    api_key: str | None = None
    timeout: float = 60.0
    temperature: float | None = None
    first_token_t: float | None = None
    text: str = ""
    stop: threading.Event = field(default_factory=threading.Event)

    def __iter__(self) -> Iterator[str]:
        import httpx

        full = endpoint(self.url, "/chat/completions")
        body: dict = {"model": self.model, "messages": self.messages, "stream": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        try:
            with httpx.stream("POST", full, json=body, headers=bearer(self.api_key),
                              timeout=httpx.Timeout(self.timeout, read=self.timeout)) as r:
                if r.status_code != 200:
                    raise TalkError(f"LLM endpoint {full} failed: HTTP {r.status_code}: {error_message(r.read())}")
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    piece = _content(full, data)
                    if piece:
                        self.first_token_t = self.first_token_t or time.perf_counter()
                        self.text += piece
                        yield piece
        except httpx.HTTPError as e:
            raise endpoint_error("LLM", full, e) from None


def _content(full: str, data: str) -> str:
    """One event's data (a chat.completion.chunk) -> its content piece ("" if none); TalkError for an error."""
    try:
        msg = json.loads(data)
    except ValueError:
        raise TalkError(f"LLM endpoint {full} sent a line that is not JSON: {data[:80]!r}") from None
    if isinstance(msg, dict) and "error" in msg:
        raise TalkError(f"LLM endpoint {full} failed: {error_message(data.encode())}")
    try:
        return (msg["choices"][0].get("delta") or {}).get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
