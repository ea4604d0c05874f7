"""talk's CSM behind a running `csmserve serve` (--url): ServerSpeech, over the server's WebSocket
(/v1/audio/speech/stream) with one context_id for the conversation. The server keeps the turns: the
user's audio is encoded there once, on arrival, and its generated replies' codes stay there."""
from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from csmserve.apps.common import base_url, bearer, from_pcm16, wav_bytes
from csmserve.apps.talk.errors import TalkError
from csmserve.apps.talk.speech import SpeechChunk
from csmserve.config import FRAME_SAMPLES

if TYPE_CHECKING:
    from csmserve.api import Segment
    from csmserve.apps.talk.llm import LLMStream


class ServerSpeech:
    """A SpeechBackend: each reply is add_context (the user's turn), the LLM's pieces as `text`, `flush`;
    a barge-in sends `cancel`, then the reply as played as add_context (the server drops a cancelled turn)."""

    frame_size = FRAME_SAMPLES

    def __init__(self, url: str, context_id: str, api_key: str | None = None, voice: str | None = None,
                 timeout: float = 60.0) -> None:
        self.url, self.context_id, self.api_key, self.voice, self.timeout = url, context_id, api_key, voice, timeout
        self._ws = None
        self._user_wav: bytes | None = None  # the user's audio file, for the next reply's add_context

    def user_turn(self, speaker: int, text: str, wav: bytes | None, pcm: np.ndarray | None) -> Segment:
        from csmserve.api import Segment

        self._user_wav = wav
        return Segment(speaker, text, audio=None if wav is None else pcm)  # the server encodes it

    def reply(self, llm: LLMStream, speaker: int, context: list[Segment], sampling: dict) -> Iterator[SpeechChunk]:
        """One reply over the WebSocket: the user's turn (context[-1]) as add_context, the LLM's pieces as
        they arrive, flush -> chunks of audio as they come. Leaving early cancels the turn on the server."""
        user = context[-1]
        entry: dict = {"speaker": user.speaker, "text": user.text}
        if self._user_wav is not None:
            entry["audio"] = base64.b64encode(self._user_wav).decode()
        first: dict = {"context_id": self.context_id, "speaker": speaker, "output_format": "pcm_s16le",
                       **{k: v for k, v in sampling.items() if v is not None}}
        if self.voice:
            first["voice"] = self.voice
        self._send({**first, "add_context": [entry]})
        reply = _Reply(self, llm)
        reply.feeder.start()
        try:
            yield from reply.receive()
        finally:
            llm.stop.set()
            if not reply.finished and self._ws is not None:  # barge-in (or an error): stop the server's turn
                reply.cancel()
        if reply.error is not None:
            raise reply.error

    def cut(self, reply: Segment) -> None:
        audio = base64.b64encode(wav_bytes(reply.audio)).decode()
        self._send({"context_id": self.context_id,
                    "add_context": [{"speaker": reply.speaker, "text": reply.text, "audio": audio}]})

    def close(self) -> None:
        self._drop()

    def _connect(self):
        if self._ws is None:
            from websockets.sync.client import connect

            ws_url = (base_url(self.url).replace("https://", "wss://").replace("http://", "ws://")
                      + "/v1/audio/speech/stream")
            kw = dict(additional_headers=bearer(self.api_key) or None, open_timeout=self.timeout, max_size=None)
            try:
                try:
                    self._ws = connect(ws_url, legacy=True, **kw)  # websockets >= 17: a connection, no warning
                except TypeError:
                    self._ws = connect(ws_url, **kw)
            except Exception as e:  # noqa: BLE001 - any connection failure is one line
                raise TalkError(f"csmserve server {ws_url} is unreachable ({type(e).__name__}: {e})") from None
        return self._ws

    def _send(self, msg: dict) -> None:
        try:
            self._connect().send(json.dumps(msg))
        except TalkError:
            raise
        except Exception as e:  # noqa: BLE001
            self._drop()
            raise TalkError(f"csmserve server {self.url}: connection lost ({type(e).__name__}: {e})") from None

    def _drop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001
                pass
            self._ws = None


class _Reply:
    """One reply in flight: a thread sends the LLM's pieces as `text` (then `flush`) while receive() yields
    the audio coming back. `finished`: the server ended the turn (or the connection is gone)."""

    def __init__(self, speech: ServerSpeech, llm: LLMStream) -> None:
        self.speech, self.ws, self.cid, self.llm = speech, speech._ws, speech.context_id, llm
        self.sent, self.done, self.finished = 0, False, False
        self.error: Exception | None = None  # the LLM's (re-raised after the reply)
        self.feeder = threading.Thread(target=self._feed, daemon=True, name="csmserve-talk-ws-send")

    def _feed(self) -> None:
        try:
            for piece in self.llm:
                if self.llm.stop.is_set():
                    break
                self.ws.send(json.dumps({"context_id": self.cid, "text": piece}))
                self.sent += 1
        except Exception as e:  # noqa: BLE001 - re-raised after the turn
            self.error = e
        finally:
            try:
                if self.sent and not self.llm.stop.is_set():
                    self.ws.send(json.dumps({"context_id": self.cid, "flush": True}))
            except Exception:  # noqa: BLE001
                pass
            self.done = True

    def receive(self) -> Iterator[SpeechChunk]:
        url = self.speech.url
        while not (self.done and not self.sent):  # (the LLM said nothing: no turn to wait for)
            try:
                raw = self.ws.recv(timeout=0.05)
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001
                self.finished = True
                self.speech._drop()
                raise TalkError(f"csmserve server {url}: connection lost ({type(e).__name__})") from None
            if not isinstance(raw, str):
                continue
            m = json.loads(raw)
            if m.get("type") == "audio":
                yield SpeechChunk(None, from_pcm16(base64.b64decode(m["audio"])), m.get("segment", 0), m.get("text"))
            elif m.get("type") == "flush_done":
                self.finished = True
                yield SpeechChunk(None, np.zeros(0, np.float32), 0, None, True, m.get("finish_reason"))
                return
            elif m.get("type") == "error":
                raise TalkError(f"csmserve server {url}: {m.get('error', {}).get('message', m)}")
        self.finished = True

    def cancel(self) -> None:
        """Stop the server's turn: `cancel`, then wait for `cancelled` (no text after it: it would start a new turn)."""
        self.feeder.join(timeout=2.0)
        try:
            self.ws.send(json.dumps({"context_id": self.cid, "cancel": True}))
            deadline = time.monotonic() + self.speech.timeout
            while time.monotonic() < deadline:
                raw = self.ws.recv(timeout=max(0.01, deadline - time.monotonic()))
                if isinstance(raw, str) and json.loads(raw).get("type") == "cancelled":
                    break
        except Exception:  # noqa: BLE001
            self.speech._drop()
