"""Where talk's CSM runs: the SpeechBackend protocol, and CSM in this process (InProcessSpeech);
apps/talk/websocket.py has CSM behind a running `csmserve serve` (ServerSpeech)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from csmserve.api import CSM, Segment
    from csmserve.apps.talk.llm import LLMStream


@dataclass
class SpeechChunk:
    """A piece of a spoken reply: what the session reads of an api.AudioChunk (codes None from a server)."""

    codes: np.ndarray | None
    audio: np.ndarray
    segment: int  # which sentence of the reply
    text: str | None  # that sentence
    final: bool = False
    finish_reason: str | None = None


class SpeechBackend(Protocol):
    """CSM for a TalkSession: in this process (InProcessSpeech) or behind a csmserve server (ServerSpeech)."""

    frame_size: int  # audio samples per frame

    def user_turn(self, speaker: int, text: str, wav: bytes | None, pcm: np.ndarray | None) -> Segment:
        """The user's turn as the context keeps it (`wav`: the file as given, `pcm`: decoded; None: typed)."""

    def reply(self, llm: LLMStream, speaker: int, context: list[Segment], sampling: dict) -> Iterator[SpeechChunk]:
        """The reply to `context` (its last segment the user's turn) as the LLM's pieces arrive -> chunks as
        they come (a generator: closing it early stops the reply)."""

    def cut(self, reply: Segment) -> None:
        """The reply was cut at barge-in; `reply` is what was played (now in the session's context)."""

    def close(self) -> None:
        """Let go of what the backend holds (not an in-process CSM: its owner closes it)."""


class InProcessSpeech:
    """CSM in this process: the user's audio Mimi-encoded once, the reply from CSM.speak over the LLM's pieces."""

    def __init__(self, csm: CSM) -> None:
        self.csm = csm
        self.frame_size = csm.frame_size

    def user_turn(self, speaker: int, text: str, wav: bytes | None, pcm: np.ndarray | None) -> Segment:
        from csmserve.api import Segment

        return Segment(speaker, text, codes=None if pcm is None else self.csm.encode_audio(pcm))

    def reply(self, llm: LLMStream, speaker: int, context: list[Segment], sampling: dict) -> Iterator:
        return self.csm.speak(iter(llm), speaker=speaker, context=context, **sampling)

    def cut(self, reply: Segment) -> None:
        pass  # the context holds the reply's codes as played: the next prompt is built from it

    def close(self) -> None:
        pass
