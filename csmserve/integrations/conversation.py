"""One csmserve conversation over the WebSocket, for voice-agent frameworks (asyncio).

    conv = Conversation("http://localhost:8000", voice="alloy")
    await conv.connect()
    conv.add_user_audio(pcm16, 16000)                  # the user's turn: audio as it is heard ...
    conv.end_user_turn("What is the weather like?")    # ... then its transcript (sent with the next reply)
    reply = await conv.say("It is ", key="turn-1")     # the LLM's text as it arrives
    await conv.say("sunny today.", key="turn-1")
    await conv.flush("turn-1")
    async for event in reply:                          # ReplyAudio | ReplySegment, until flush_done
        ...
    await conv.interrupt(audio_end_ms=880)             # barge-in: keep what was played, drop the rest

Protocol (docs/api.md): the conversation is one `context_id`; a reply is one turn (`text` pieces, then
`flush`); a user turn is an `add_context` turn (audio as a WAV) sent just before the next reply's text.
The server generates one turn at a time, in order, so every audio message belongs to the oldest reply
not yet flushed out.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import uuid
import wave
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

log = logging.getLogger("csmserve.integrations")
MIN_USER_SECONDS = 0.1  # shorter user audio goes as text only (the server refuses clips under one frame)


class ConversationError(RuntimeError):
    """The server refused a message or the connection failed (one line, from the server's error)."""


@dataclass
class ReplyAudio:
    pcm: bytes  # s16le mono 24 kHz
    frame_start: int  # first frame within the reply
    num_frames: int
    segment: int
    text: str


@dataclass
class ReplySegment:
    """Where a segment (sentence) of the reply starts and ends in its audio (exact, from frame counts)."""

    segment: int
    text: str
    audio_start_ms: int
    audio_end_ms: int


@dataclass
class Reply:
    """One assistant turn: text in, events out (ReplyAudio, ReplySegment) until the server's flush_done."""

    key: str
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ReplyAudio | ReplySegment | None (end)
    frames: int = 0  # frames received
    request_id: str | None = None
    done: bool = False  # flush_done received (generation finished)
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False

    async def __aiter__(self) -> AsyncIterator[ReplyAudio | ReplySegment]:
        while (event := await self.events.get()) is not None:
            yield event
        if self.error is not None:
            raise ConversationError(self.error)


class Conversation:
    """A `context_id` on a csmserve server: user turns in as context, replies out as they are generated."""

    def __init__(self, url: str = "http://localhost:8000", *, voice: str | None = None, api_key: str | None = None,
                 context_id: str | None = None, speaker: int | None = None, user_speaker: int = 1,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, max_audio_length_ms: int | None = None,
                 max_segment_length_ms: int | None = None, max_user_seconds: float = 30.0) -> None:
        base = url.rstrip("/")
        base = base[:-3] if base.endswith("/v1") else base
        self.ws_url = base.replace("https://", "wss://").replace("http://", "ws://") + "/v1/audio/speech/stream"
        self.api_key, self.user_speaker, self.max_user_seconds = api_key, user_speaker, max_user_seconds
        self.context_id = context_id or f"conv-{uuid.uuid4().hex}"
        given = dict(voice=voice, speaker=speaker, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     max_audio_length_ms=max_audio_length_ms, max_segment_length_ms=max_segment_length_ms)
        self.settings = {k: v for k, v in given.items() if v is not None}
        self.replies: deque[Reply] = deque()  # not yet finished (flush_done), oldest first: the server's order
        self._open: Reply | None = None  # the reply still taking text
        self._user_pcm: list[bytes] = []  # the user's audio since the last user turn (s16le mono)
        self._user_rate = 16_000
        self._user_turns: list[dict] = []  # ended user turns, sent before the next reply's text
        self._ws = None
        self._reader: asyncio.Task | None = None
        self._dropping = 0  # cancels sent whose `cancelled` has not come back: their turn's audio is dropped
        self._cancelled: deque[Reply] = deque()  # the replies those cancels stopped, oldest first: one that
        # the server finished before the cancel reached it still gets its flush_done (request_id, frames)
        self._waiters: deque[tuple[str, asyncio.Future]] = deque()  # ("cancelled" | "truncated", future)
        self._lock = asyncio.Lock()

    # ---- connection
    @property
    def connected(self) -> bool:
        return self._ws is not None and self._reader is not None and not self._reader.done()

    async def connect(self) -> None:
        if self.connected:
            return
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self._ws = await connect(self.ws_url, additional_headers=headers, max_size=None)
        except Exception as e:  # noqa: BLE001 - any connection failure is one line
            raise ConversationError(f"csmserve at {self.ws_url} is unreachable ({type(e).__name__}: {e})") from None
        self._reader = asyncio.get_running_loop().create_task(self._read(self._ws), name="csmserve-conversation")
        await self._send({"context_id": self.context_id, "output_format": "pcm_s16le", "add_timestamps": True,
                          **self.settings})

    async def close(self, forget: bool = False) -> None:
        """Close the connection; forget=True also ends the server's session (`close`)."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            if forget:
                await ws.send(json.dumps({"context_id": self.context_id, "close": True}))
            await ws.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._end_all("the connection closed")

    async def _send(self, msg: dict) -> None:
        if self._ws is None:
            await self.connect()
        try:
            await self._ws.send(json.dumps(msg, separators=(",", ":")))
        except Exception as e:  # noqa: BLE001
            self._end_all(f"connection lost ({type(e).__name__})")
            self._ws = None
            raise ConversationError(f"csmserve at {self.ws_url}: connection lost ({type(e).__name__}: {e})") from None

    # ---- the user's side
    def add_user_audio(self, pcm: bytes, sample_rate: int, num_channels: int = 1) -> None:
        """Audio of the user's current turn (s16le); kept until end_user_turn."""
        if num_channels != 1:
            import numpy as np

            pcm = np.frombuffer(pcm, "<i2").reshape(-1, num_channels).mean(axis=1).astype("<i2").tobytes()
        if sample_rate != self._user_rate and self._user_pcm:
            self._user_pcm = []  # a new rate mid-turn: keep the newest audio only
        self._user_rate = sample_rate
        self._user_pcm.append(pcm)
        limit = int(self.max_user_seconds * sample_rate) * 2
        while sum(map(len, self._user_pcm)) > limit and len(self._user_pcm) > 1:
            self._user_pcm.pop(0)

    def discard_user_audio(self) -> None:
        self._user_pcm = []

    def end_user_turn(self, text: str = "") -> dict | None:
        """The user's audio and transcript -> one context turn, sent before the next reply's text (None if empty)."""
        pcm, self._user_pcm = b"".join(self._user_pcm), []
        turn: dict = {"speaker": self.user_speaker, "text": " ".join(text.split())}
        if len(pcm) // 2 >= MIN_USER_SECONDS * self._user_rate:
            turn["audio"] = base64.b64encode(wav_bytes(pcm, self._user_rate)).decode()
        if "audio" not in turn and not turn["text"]:
            return None
        self._user_turns.append(turn)
        return turn

    # ---- the assistant's side
    async def say(self, text: str, key: str | None = None) -> Reply:
        """Text of a reply as it arrives (`key` names the reply; a new key starts a new reply)."""
        async with self._lock:
            reply = await self._reply(key)
            if text:
                await self._send({"context_id": self.context_id, "text": text})
            return reply

    async def flush(self, key: str | None = None) -> Reply | None:
        """The reply's text is complete: the server speaks the rest and answers flush_done."""
        async with self._lock:
            reply = self._open if key is None or (self._open is not None and self._open.key == key) else None
            if reply is None:
                return None
            self._open = None
            await self._send({"context_id": self.context_id, "flush": True})
            return reply

    async def _reply(self, key: str | None) -> Reply:
        if self._open is not None and (key is None or self._open.key == key):
            return self._open
        if self._open is not None:  # a new reply while the last one still takes text: end that one
            await self._send({"context_id": self.context_id, "flush": True})
        if not self.connected:
            await self.connect()
        if self._user_turns:
            turns, self._user_turns = self._user_turns, []
            await self._send({"context_id": self.context_id, "add_context": turns})
        self._open = Reply(key or uuid.uuid4().hex)
        self.replies.append(self._open)
        return self._open

    async def interrupt(self, audio_end_ms: int | None = None) -> dict:
        """Barge-in: stop every reply in flight; the generating one keeps its first `audio_end_ms` (whole
        80 ms frames; None: nothing) in the session. A reply the server finished before the cancel came still
        gets its flush_done's request_id, frames and `done` (cut it with `truncate`). -> the `cancelled`
        message (request_id and num_frames of the turn it stopped; neither if none was generating)."""
        async with self._lock:
            replies = list(self.replies)
            self.replies.clear()
            self._open = None
            msg: dict = {"context_id": self.context_id, "cancel": True}
            if audio_end_ms is not None:
                msg["audio_end_ms"] = max(0, int(audio_end_ms))
            self._dropping += 1
            self._cancelled.extend(replies)
            fut = self._expect("cancelled")
            await self._send(msg)
            for r in replies:
                r.cancelled = True
                r.events.put_nowait(None)
        return await asyncio.wait_for(fut, timeout=30)

    async def truncate(self, request_id: str, audio_end_ms: int) -> dict:
        """Cut a finished reply (by its request_id) in the session at what was played."""
        async with self._lock:
            fut = self._expect("truncated")
            await self._send({"context_id": self.context_id, "truncate": True, "request_id": request_id,
                              "audio_end_ms": max(0, int(audio_end_ms))})
        return await asyncio.wait_for(fut, timeout=30)

    def _expect(self, kind: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((kind, fut))
        return fut

    # ---- reading
    async def _read(self, ws) -> None:
        try:
            async for raw in ws:
                if isinstance(raw, str):
                    self._dispatch(json.loads(raw))
        except Exception as e:  # noqa: BLE001 - the connection broke: every reply ends with the reason
            self._end_all(f"connection lost ({type(e).__name__})")
            return
        self._end_all("the server closed the connection")

    def _dispatch(self, m: dict) -> None:
        kind = m.get("type")
        if m.get("context_id") not in (self.context_id, None):
            return
        if kind in ("cancelled", "truncated"):
            if kind == "cancelled":
                self._dropping = max(0, self._dropping - 1)
                if not self._dropping:
                    self._cancelled.clear()
            for i, (k, fut) in enumerate(self._waiters):
                if k == kind:
                    del self._waiters[i]
                    if not fut.done():
                        fut.set_result(m)
                    break
            return
        if kind == "error" and self._waiters:
            err = m.get("error", {})
            # a refused truncate names its request_id or audio_end_ms (a reply may be generating meanwhile: not its
            # error); any other error with no reply running is the oldest waiter's
            i = (next((i for i, (k, _) in enumerate(self._waiters) if k == "truncated"), None)
                 if err.get("param") in ("request_id", "audio_end_ms") else None if self.replies else 0)
            if i is not None:
                _, fut = self._waiters[i]
                del self._waiters[i]
                if not fut.done():
                    fut.set_exception(ConversationError(err.get("message", str(m))))
                return
        if self._dropping and kind == "flush_done" and self._cancelled:  # finished before the cancel came
            r = self._cancelled.popleft()
            r.done, r.request_id, r.finish_reason = True, m.get("request_id"), m.get("finish_reason")
            r.frames = m.get("num_frames", r.frames)
            return
        if self._dropping or not self.replies:
            if kind == "error":
                log.warning("csmserve: %s", m.get("error", {}).get("message", m))
            return
        reply = self.replies[0]
        if kind == "audio":
            pcm = base64.b64decode(m["audio"])
            reply.frames += m["num_frames"]
            reply.events.put_nowait(ReplyAudio(pcm, m["frame_start"], m["num_frames"], m["segment"], m["text"]))
        elif kind == "segment_done":
            reply.request_id = m.get("request_id") or reply.request_id
            reply.events.put_nowait(ReplySegment(m["segment"], m.get("text", ""), m["audio_start_ms"],
                                                 m["audio_end_ms"]))
        elif kind == "flush_done":
            self.replies.popleft()
            reply.done, reply.request_id, reply.finish_reason = True, m.get("request_id"), m.get("finish_reason")
            reply.events.put_nowait(None)
        elif kind == "error":
            self.replies.popleft()
            if self._open is reply:
                self._open = None
            reply.done, reply.error = True, m.get("error", {}).get("message", str(m))
            reply.events.put_nowait(None)

    def _end_all(self, why: str) -> None:
        for r in self.replies:
            if not r.done:
                r.done, r.error = True, why
                r.events.put_nowait(None)
        self.replies.clear()
        self._open = None
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(ConversationError(why))
        self._waiters.clear()
        self._dropping = 0
        self._cancelled.clear()


def wav_bytes(pcm: bytes, rate: int) -> bytes:
    """s16le mono -> a WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()
