"""WebSocket /v1/audio/speech/stream: text streamed in, audio out as generated, conversation sessions,
cancel. The protocol is in docs/api.md.

A context's text pieces form its current turn (an `Utterance`, cut into segments by its TextFeed); once the
first segment is complete the turn becomes ONE open long-form request (ServerState.plan_turn), later segments
are appended to it in the same slot (one continuous audio stream), and `flush` / `close` ends the input (the
rest is spoken, then a `flush_done`). One connection generates one turn at a time, in the order they started.
A context_id is a session (server/sessions.py) that outlives the connection. `cancel` with `audio_end_ms`
keeps what the client played of the turn (whole frames); `truncate` cuts a finished assistant turn there.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import re
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import pydantic_core
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from csmserve.audio.encoders import to_s16le
from csmserve.engine import trace
from csmserve.engine.request import AudioChunk
from csmserve.prompt.segments import segment_spans
from csmserve.server.errors import APIError, check_bearer, validation_error
from csmserve.server.schemas import WsRequest
from csmserve.server.sessions import Session, SessionTurn
from csmserve.server.state import ServerState
from csmserve.server.timestamps import FRAME_MS, SegmentClock, SegmentSpan

if TYPE_CHECKING:
    from csmserve.api import CSM, Segment

log = logging.getLogger("csmserve.server")
router = APIRouter()


class Utterance:
    """What a context says next: its text streamed in (a TextFeed) and spoken as one open long-form request."""

    def __init__(self, session: Session, csm: CSM) -> None:
        from csmserve.api import TextFeed

        self.session = session
        self.context_id = session.context_id
        self.text_feed = TextFeed(csm)  # its segments (AudioChunk.segment indexes them), the request they feed
        self.received = ""  # all text of this utterance so far (offsets refer to it)
        self.spans: list[tuple[int, int]] = []  # each segment's [start, end) in `received`
        self.queued = False  # in the connection's jobs (it had a complete segment)
        self.cancelled = False
        self.finished = False  # generated and kept in the session: only its flush_done is left to send
        self.idle_timeout = False  # ended by the server: no text for ws_turn_idle_s
        self.last_text = time.monotonic()
        # while it generates: its request, speaker and codes so far per segment (a cancel may keep some)
        self.request_id: str | None = None
        self.speaker = 0
        self.codes: dict[int, list[np.ndarray]] = {}

    @property
    def texts(self) -> list[str]:
        """Its complete segments, in order."""
        return self.text_feed.texts

    def feed(self, text: str) -> int:
        """-> the number of segments this piece completed."""
        self.received += text
        self.last_text = time.monotonic()
        return self._spans(self.text_feed.feed(text))

    def end(self) -> None:
        self._spans(self.text_feed.end())

    def _spans(self, segments: list[str]) -> int:
        cursor = self.spans[-1][1] if self.spans else 0  # the next words of the text, in order
        self.spans += segment_spans(self.received, segments, cursor)
        return len(segments)


class Connection:
    def __init__(self, ws: WebSocket, state: ServerState, binary: bool, progress: bool) -> None:
        self.ws, self.state, self.binary, self.progress = ws, state, binary, progress
        self.open: dict[str, Utterance] = {}  # context_id -> its turn still taking text
        self.jobs: deque[Utterance | str] = deque()  # turns to generate; a str: send `done` for that context_id
        self.wake = asyncio.Event()
        self.current: tuple[Utterance, asyncio.Task] | None = None
        self.send_lock = asyncio.Lock()

    async def send(self, payload: dict | bytes) -> None:
        async with self.send_lock:
            if isinstance(payload, bytes):
                await self.ws.send_bytes(payload)
            else:
                await self.ws.send_text(json.dumps(payload, separators=(",", ":")))

    async def error(self, err: APIError, context_id: str | None = None) -> None:
        await self.send({"type": "error", "context_id": context_id, **err.body()})

    # ---- reading
    async def receive_loop(self) -> None:
        """Every message gets handled or an `error`; none ends the connection (only the client's close)."""
        limit = self.state.config.max_ws_message_bytes
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            raw = message.get("text")
            if raw is None:  # a binary frame
                await self.error(APIError(400, "binary messages are not part of the protocol; send JSON as text",
                                          "invalid_message"))
                continue
            if len(raw) * 4 > limit and (size := len(raw.encode("utf-8", "surrogatepass"))) > limit:  # UTF-8 bytes
                await self.error(APIError(400, f"the message is {size} bytes; the limit is {limit} "
                                          "(--max-ws-message-bytes)", "message_too_large"), _context_id(raw[:4096]))
                continue
            try:
                msg = (await asyncio.to_thread(WsRequest.model_validate_json, raw) if len(raw) > 65536
                       else WsRequest.model_validate_json(raw))
            except ValidationError as e:
                err = validation_error(e)
                if err.code == "invalid_json":  # not JSON at all, or JSON but not an object (`[1,2]`, `null`)
                    first = e.errors(include_input=False)[:1]
                    if first and first[0]["type"] == "json_invalid":
                        err = APIError(400, f"message is not valid JSON: {err.message.partition(': ')[2]}",
                                       "invalid_json")
                    else:
                        err = APIError(400, 'the message must be a JSON object, e.g. {"text": "Hello."}',
                                       "invalid_message")
                await self.error(err, _context_id(raw))
                continue
            try:
                await self.handle(msg)
            except APIError as e:
                await self.error(e, msg.context_id)
            except Exception as e:  # a bug, not the client's: it ends this message only
                log.exception("websocket message failed")
                await self.error(APIError(500, f"internal server error: {type(e).__name__}", "internal_error"),
                                 msg.context_id)

    async def handle(self, msg: WsRequest) -> None:
        cid = msg.context_id
        if msg.cancel:
            kept = await self.cancel(cid, msg.audio_end_ms)
            await self.send({"type": "cancelled", "context_id": cid, **kept})
            return
        sessions = self.state.sessions
        if msg.truncate:
            await self.send({"type": "truncated", "context_id": cid, **self.truncate(cid, msg)})
            return
        session = sessions.open(cid)
        changed = session.update(msg)
        if msg.context is not None:  # encoded once, here
            session.context = await self.state.context_segments(msg.context)
            changed = True
        if changed:
            sessions.save(session)
        if msg.add_context:
            segments = await self.state.context_segments(msg.add_context, "add_context")
            sessions.add_turn(session, SessionTurn("user", segments))
        if msg.text:
            turn = self.open.get(cid)
            if turn is None or turn.session is not session:  # (a session forgotten meanwhile: a new turn)
                turn = Utterance(session, self.state.csm)
            limit = self.state.config.max_input_chars
            if len(turn.received) + len(msg.text) > limit:
                raise APIError(400, f"the turn's text would be longer than {limit} characters; flush more often",
                               "input_too_long", "text")
            self.open[cid] = turn
            if turn.feed(msg.text) and not turn.queued:
                self._queue(turn)  # its first segment is complete: generation starts
        if msg.flush or msg.close:
            self._end_turn(cid)
        if msg.close:
            sessions.drop(cid)  # queued turns keep their session; new messages start a fresh one
            self.jobs.append(cid)
            self.wake.set()

    def _end_turn(self, cid: str) -> None:
        """No more text for this context's turn (flush, close, idle timeout): the rest is spoken, then it ends."""
        turn = self.open.pop(cid, None)
        if turn is not None:
            turn.end()
            if turn.texts and not turn.queued:
                self._queue(turn)

    async def idle_loop(self) -> None:
        """A turn with no text for ws_turn_idle_s is flushed: an open request must not idle in a slot forever."""
        idle = self.state.config.ws_turn_idle_s
        while True:
            now = time.monotonic()
            for turn in [t for t in self.open.values() if now - t.last_text >= idle]:
                turn.idle_timeout = True
                self._end_turn(turn.context_id)
            due = min((t.last_text + idle for t in self.open.values()), default=now + idle)
            await asyncio.sleep(max(0.01, due - time.monotonic()))

    def _queue(self, turn: Utterance) -> None:
        turn.queued = True
        self.jobs.append(turn)
        self.wake.set()

    async def cancel(self, cid: str, audio_end_ms: int | None = None) -> dict:
        """Stop the context's turn; with audio_end_ms, keep what was played of it in the session. -> the
        `cancelled` message's extra fields (request_id, num_frames kept)."""
        turn = self.open.pop(cid, None)
        if turn is not None:
            turn.cancelled = True
        for job in self.jobs:
            if isinstance(job, Utterance) and job.context_id == cid:
                job.cancelled = True
        self.jobs = deque(j for j in self.jobs if not (j == cid or (isinstance(j, Utterance) and j.cancelled)))
        if self.current is None or self.current[0].context_id != cid:
            return {}
        running, task = self.current
        if running.finished:  # the cancel crossed the turn's end: it stops nothing, flush_done goes out first
            await asyncio.wait([task])
            return {}
        task.cancel()
        await asyncio.wait([task])  # its codes are final, and the next message sees the session as cut
        if audio_end_ms is None:  # nothing kept: the turn is dropped
            return {}
        from csmserve.api import Segment

        out, texts = {"request_id": running.request_id, "num_frames": 0}, running.texts
        spoken = [Segment(running.speaker, texts[i] if i < len(texts) else "", codes=np.concatenate(c))
                  for i, c in sorted(running.codes.items())]
        segments = _first_frames(spoken, audio_end_ms // FRAME_MS)  # a segment partly played keeps its text
        if segments:
            self.state.sessions.add_turn(running.session, SessionTurn("assistant", segments,
                                                                      request_id=running.request_id))
            out["num_frames"] = sum(len(seg.codes) for seg in segments)
        return out

    def truncate(self, cid: str, msg: WsRequest) -> dict:
        """Cut an assistant turn of the session (request_id, else the newest) at audio_end_ms (whole frames)."""
        session = self.state.sessions.get(cid)
        if msg.audio_end_ms is None:
            raise APIError(400, "'truncate' needs 'audio_end_ms' (how much of the turn was played)",
                           "missing_required_parameter", "audio_end_ms")
        turns = [t for t in (session.turns if session is not None else []) if t.role == "assistant"
                 and (msg.request_id is None or t.request_id == msg.request_id)]
        if not turns:
            raise APIError(400, f"context {cid!r} has no assistant turn" + (
                f" from request {msg.request_id!r}" if msg.request_id else "") + " to truncate",
                "invalid_value", "request_id" if msg.request_id else "context_id")
        turn = turns[-1]
        turn.segments = _first_frames(turn.segments, msg.audio_end_ms // FRAME_MS)
        if not turn.segments:
            session.turns.remove(turn)
        self.state.sessions.save(session)  # every API worker sees the cut
        return {"request_id": turn.request_id, "num_frames": turn.frames}

    # ---- generating
    async def work_loop(self) -> None:
        while True:
            while not self.jobs:
                self.wake.clear()
                await self.wake.wait()
            job = self.jobs.popleft()
            if isinstance(job, str):
                await self.send({"type": "done", "context_id": job})
                continue
            if job.cancelled:
                continue
            task = asyncio.create_task(self.generate(job))
            self.current = (job, task)
            try:
                await task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the connection itself is going away
                    raise
                # else: a `cancel` message cancelled just this turn
            except APIError as e:
                await self.error(e, job.context_id)
            except Exception as e:
                log.exception("websocket generation failed")
                await self.error(APIError(500, f"generation failed: {e}", "generation_failed"), job.context_id)
            finally:
                self.current = None
                if self.open.get(job.context_id) is job:  # ended early (an error): later text starts a new turn
                    del self.open[job.context_id]

    async def generate(self, turn: Utterance) -> None:
        from csmserve.api import Segment

        arrival = time.perf_counter()
        session = turn.session  # it has a segment: an utterance is queued once it has one
        session.busy += 1
        try:
            # one long-form request: the segments so far go in now; the rest is appended as they complete
            plan = await self.state.plan_turn(session, turn.text_feed)
            request, speaker, codes = plan.request, plan.args.speaker, turn.codes
            turn.request_id, turn.speaker = request.request_id, speaker
            frames, reason, shown, clock = 0, None, -1, SegmentClock()
            async for chunk in self.state.stream(request, arrival, turn.text_feed.start if request.open else None):
                if len(chunk.codes):
                    codes.setdefault(chunk.segment, []).append(chunk.codes)
                    if not frames and trace.current() is not None:  # the turn's first audio goes out
                        trace.current().done(request.request_id, written=time.perf_counter())
                    await self._send_audio(turn, chunk, new_segment=chunk.segment != shown)
                    shown = chunk.segment
                    frames += len(chunk.codes)
                for span in clock.feed(chunk):
                    await self._send_segment_done(turn, span)
                if chunk.final:
                    reason = chunk.finish_reason
        finally:
            turn.text_feed.stop()
            session.busy -= 1
        turn.finished = True
        if codes:  # this turn (each segment as it was spoken: its text and codes) is context for the next
            self.state.sessions.add_turn(session, SessionTurn("assistant", [
                Segment(speaker, turn.texts[i], codes=np.concatenate(c)) for i, c in sorted(codes.items())],
                request_id=request.request_id))
        else:
            self.state.sessions.touch(session)
        done = {"type": "flush_done", "context_id": turn.context_id, "request_id": request.request_id,
                "num_frames": frames, "finish_reason": reason, "num_segments": len(turn.texts),
                "text_end": turn.spans[-1][1] if turn.spans else 0}
        await self.send({**done, "idle_timeout": True} if turn.idle_timeout else done)

    async def _send_audio(self, turn: Utterance, chunk: AudioChunk, new_segment: bool) -> None:
        audio = chunk.audio
        data = audio.astype("<f4").tobytes() if turn.session.output_format == "pcm_f32le" else to_s16le(audio)
        i = chunk.segment
        where = {"segment": i, "text": turn.texts[i], "text_start": turn.spans[i][0], "text_end": turn.spans[i][1]}
        if self.binary:
            if self.progress and new_segment:
                await self.send({"type": "segment", "context_id": turn.context_id, "frame_start": chunk.frame_start,
                                 "audio_start_ms": chunk.frame_start * FRAME_MS, **where})
            await self.send(data)
        else:
            await self.send({"type": "audio", "context_id": turn.context_id, "audio": base64.b64encode(data).decode(),
                             "frame_start": chunk.frame_start, "num_frames": len(chunk.codes), **where})

    async def _send_segment_done(self, turn: Utterance, span: SegmentSpan) -> None:
        """Where a segment started and ended in the turn's audio (exact, from frame counts)."""
        if not turn.session.add_timestamps:
            return
        i = span.segment
        where = {"text": turn.texts[i], "text_start": turn.spans[i][0], "text_end": turn.spans[i][1]} \
            if i < len(turn.texts) else {}
        await self.send({"type": "segment_done", "context_id": turn.context_id, "request_id": turn.request_id,
                         **span.fields(), **where})


def _first_frames(segments: list[Segment], frames: int) -> list[Segment]:
    """The first `frames` frames of a turn's segments (one without codes is kept whole)."""
    kept = []
    for seg in segments:
        if frames <= 0:
            break
        if seg.codes is not None:
            seg = type(seg)(seg.speaker, seg.text, codes=seg.codes[:frames])
            frames -= len(seg.codes)
        kept.append(seg)
    return kept


_CONTEXT_ID = re.compile(r'"context_id"\s*:\s*"([^"\\]{1,256})"')


def _context_id(raw: str) -> str | None:
    """The context_id of a message that failed validation (partial JSON of a cut message; else the first
    `"context_id": "..."` of its first 4 KB)."""
    try:
        value = pydantic_core.from_json(raw, allow_partial=True).get("context_id")
        return value if isinstance(value, str) and len(value) <= 256 else None
    except (ValueError, AttributeError):
        m = _CONTEXT_ID.search(raw, 0, 4096)
        return m.group(1) if m else None


def _flag(ws: WebSocket, name: str) -> bool:
    return ws.query_params.get(name, "").lower() in ("1", "true", "yes")


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.server
    await ws.accept(headers=state.headers or None)
    key, refused = state.config.api_key, None
    if key and not (check_bearer(ws.headers.get("authorization", ""), key) or
                    hmac.compare_digest(ws.query_params.get("api_key", "").encode(), key.encode())):
        refused = APIError(401, "invalid or missing API key (Authorization: Bearer <key>, or ?api_key=)",
                           "invalid_api_key"), 1008
    elif not state.ready:
        refused = APIError(503, "the model is still loading", "model_not_ready"), 1013
    if refused is not None:
        await ws.send_text(json.dumps({"type": "error", "context_id": None, **refused[0].body()}))
        await ws.close(code=refused[1])
        return
    conn = Connection(ws, state, _flag(ws, "binary"), _flag(ws, "progress"))
    tasks = [asyncio.create_task(conn.work_loop()), asyncio.create_task(conn.idle_loop())]
    try:
        await conn.receive_loop()
    except WebSocketDisconnect:
        pass
    finally:
        for task in tasks:
            task.cancel()  # the worker's: cancels the running generation, its engine request is aborted
        for task in tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
