"""talk's error: a turn that failed, as one line (the conversation goes on)."""
from __future__ import annotations

from csmserve.apps.common import CLIError


class TalkError(CLIError):
    """A turn failed (an endpoint unreachable or failing, unreadable audio): one line; the conversation goes on."""


def endpoint_error(what: str, url: str, e: Exception) -> TalkError:
    """An httpx error calling the `what` (ASR, LLM) endpoint at `url` -> its one line."""
    import httpx

    if isinstance(e, httpx.ConnectError):
        return TalkError(f"{what} endpoint {url} is unreachable ({e or 'connection refused'})")
    if isinstance(e, httpx.TimeoutException):
        return TalkError(f"{what} endpoint {url} timed out ({type(e).__name__})")
    return TalkError(f"{what} endpoint {url} failed: {type(e).__name__}: {e}")
