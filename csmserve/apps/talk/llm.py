"""talk's LLM: an OpenAI-compatible /v1/chat/completions endpoint, its reply streamed (server-sent events)."""
from __future__ import annotations

import json
import socket
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
    _response: object = field(default=None, repr=False)

    def abort(self) -> None:
        """From another thread: stop now, a read waiting for the endpoint's next line included (its connection
        closed under it)."""
        self.stop.set()
        r = self._response
        try:  # the socket shut (a blocked recv returns; closing the response from here would not wake it)
            r.extensions["network_stream"].get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        except (AttributeError, KeyError, OSError):  # no response yet, or no socket: it stops at its next line
            pass

    def __iter__(self) -> Iterator[str]:
        import httpx

        full = endpoint(self.url, "/chat/completions")
        body: dict = {"model": self.model, "messages": self.messages, "stream": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        try:
            with httpx.stream("POST", full, json=body, headers=bearer(self.api_key),
                              timeout=httpx.Timeout(self.timeout, read=self.timeout)) as r:
                self._response = r
                if r.status_code != 200:
                    raise TalkError(f"LLM endpoint {full} failed: HTTP {r.status_code}: {error_message(r.read())}")
                event: list[str] = []  # an event's data lines (joined with "\n": the SSE spec)
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    line = line.strip()
                    if line.startswith("data:"):
                        event.append(line[5:].strip())
                        data = "\n".join(event)
                        if data == "[DONE]":
                            break
                        try:
                            msg = json.loads(data)
                        except ValueError:  # its JSON goes on in the next data line (or the blank one ends it)
                            continue
                    elif line or not event:  # a comment (`: keep-alive`), a field not read, a blank between events
                        continue
                    else:  # the blank line ending an event whose data is not JSON
                        msg = _json(full, "\n".join(event))
                    event = []
                    piece = _content(full, msg)
                    if piece:
                        self.first_token_t = self.first_token_t or time.perf_counter()
                        self.text += piece
                        yield piece
                if event and "\n".join(event) != "[DONE]" and not self.stop.is_set():
                    _json(full, "\n".join(event))
        except Exception as e:
            if self.stop.is_set():  # abort() closed the connection under the read
                return
            if isinstance(e, httpx.HTTPError):
                raise endpoint_error("LLM", full, e) from None
            raise
        finally:
            self._response = None


def _json(full: str, data: str):
    try:
        return json.loads(data)
    except ValueError:
        raise TalkError(f"LLM endpoint {full} sent an event that is not JSON: {data[:80]!r}") from None


def _content(full: str, msg) -> str:
    """One event (a chat.completion.chunk, parsed) -> its content piece ("" if none); TalkError for an error."""
    if isinstance(msg, dict) and "error" in msg:
        raise TalkError(f"LLM endpoint {full} failed: {error_message(json.dumps(msg).encode())}")
    try:
        return (msg["choices"][0].get("delta") or {}).get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
