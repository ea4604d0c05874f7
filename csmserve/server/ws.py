"""WebSocket /v1/audio/speech/stream: text in (pieces, flush, close), audio out as generated,
`context_id` continuations, cancel. The protocol is in docs/api.md.

One connection runs its utterances one at a time, in the order their flushes arrived; a context
keeps its voice, settings and every generated turn (text + codes), which become the next turn's
conversation context, so the voice and prosody carry across turns.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from ..audio.encoders import to_s16le
from .errors import APIError, check_bearer, validation_error
from .schemas import ContextTurn, SamplingFields, VoiceRef, WsRequest
from .state import ServerState

log = logging.getLogger("csmserve.server")
router = APIRouter()
_SETTINGS = ("voice", "speaker", "temperature", "top_k", "top_p", "seed", "max_audio_length_ms", "output_format")


@dataclass
class Context:
    context_id: str
    voice: str | VoiceRef = "alloy"
    context: list[ContextTurn] = field(default_factory=list)  # given turns, from the first message
    fields: SamplingFields = field(default_factory=SamplingFields)
    output_format: str = "pcm_s16le"
    text: str = ""  # buffered, not yet flushed
    history: list = field(default_factory=list)  # Segments of the turns generated so far
    epoch: int = 0  # bumped by cancel: queued jobs of an older epoch are dropped

    def update(self, msg: WsRequest) -> None:
        given = msg.model_fields_set
        for name in _SETTINGS:
            if name in given and getattr(msg, name) is not None:
                if name == "voice":
                    self.voice = msg.voice
                elif name == "output_format":
                    self.output_format = msg.output_format
                else:
                    self.fields = self.fields.model_copy(update={name: getattr(msg, name)})
        if msg.context is not None:
            self.context = msg.context


@dataclass
class Job:
    ctx: Context
    text: str | None  # None: the context's close marker
    epoch: int


class Connection:
    def __init__(self, ws: WebSocket, state: ServerState, binary: bool) -> None:
        self.ws, self.state, self.binary = ws, state, binary
        self.contexts: dict[str, Context] = {}
        self.jobs: deque[Job] = deque()
        self.wake = asyncio.Event()
        self.current: tuple[Context, asyncio.Task] | None = None
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
        while True:
            raw = await self.ws.receive_text()
            try:
                msg = WsRequest.model_validate_json(raw)
            except ValidationError as e:
                err = validation_error(e) if e.errors() and e.errors()[0]["type"] != "json_invalid" \
                    else APIError(400, "message is not valid JSON", "invalid_json")
                await self.error(err, _context_id(raw))
                continue
            await self.handle(msg)

    async def handle(self, msg: WsRequest) -> None:
        ctx = self.contexts.get(msg.context_id)
        if msg.cancel:
            if ctx is not None:
                self.cancel(ctx)
            await self.send({"type": "cancelled", "context_id": msg.context_id})
            return
        if ctx is None:
            ctx = self.contexts[msg.context_id] = Context(msg.context_id)
        ctx.update(msg)
        if msg.text:
            if len(ctx.text) + len(msg.text) > self.state.config.max_input_chars:
                ctx.text = ""
                await self.error(APIError(400, f"buffered text is longer than {self.state.config.max_input_chars} "
                                          "characters; flush more often", "input_too_long", "text"), ctx.context_id)
                return
            ctx.text += msg.text
        if (msg.flush or msg.close) and ctx.text.strip():
            self.jobs.append(Job(ctx, ctx.text, ctx.epoch))
            ctx.text = ""
        if msg.close:
            self.jobs.append(Job(ctx, None, ctx.epoch))
            del self.contexts[ctx.context_id]
        self.wake.set()

    def cancel(self, ctx: Context) -> None:
        ctx.epoch += 1
        ctx.text = ""
        self.contexts.pop(ctx.context_id, None)
        if self.current is not None and self.current[0] is ctx:
            self.current[1].cancel()

    # ---- generating
    async def work_loop(self) -> None:
        while True:
            while not self.jobs:
                self.wake.clear()
                await self.wake.wait()
            job = self.jobs.popleft()
            if job.epoch != job.ctx.epoch:
                continue
            if job.text is None:
                await self.send({"type": "done", "context_id": job.ctx.context_id})
                continue
            task = asyncio.create_task(self.generate(job.ctx, job.text))
            self.current = (job.ctx, task)
            try:
                await task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the connection itself is going away
                    raise
                # else: a `cancel` message cancelled just this utterance
            except APIError as e:
                await self.error(e, job.ctx.context_id)
            except Exception as e:
                log.exception("websocket generation failed")
                await self.error(APIError(500, f"generation failed: {e}", "generation_failed"), job.ctx.context_id)
            finally:
                self.current = None

    async def generate(self, ctx: Context, text: str) -> None:
        from ..api import Segment

        arrival = time.perf_counter()
        self.state.check_input(text, "text")
        request, speaker = await self._request(ctx, text)
        codes, frames, reason = [], 0, None
        async for chunk in self.state.stream(request, arrival):
            if len(chunk.codes):
                codes.append(chunk.codes)
                await self._send_audio(ctx, chunk.audio, chunk.frame_start, len(chunk.codes))
                frames += len(chunk.codes)
            if chunk.final:
                reason = chunk.finish_reason
        if codes:  # this turn becomes context for the next one
            ctx.history.append(Segment(speaker, text, codes=np.concatenate(codes)))
            del ctx.history[:-self.state.config.max_context_turns]
        await self.send({"type": "flush_done", "context_id": ctx.context_id, "request_id": request.request_id,
                         "num_frames": frames, "finish_reason": reason})

    async def _request(self, ctx: Context, text: str):
        # the oldest generated turns go first when the prompt would not fit the model's context
        while True:
            try:
                return await self.state.build_request(text, ctx.voice, ctx.fields, ctx.context, ctx.history)
            except APIError as e:
                if e.code != "context_too_long" or not ctx.history:
                    raise
                ctx.history.pop(0)

    async def _send_audio(self, ctx: Context, audio: np.ndarray, frame_start: int, num_frames: int) -> None:
        data = audio.astype("<f4").tobytes() if ctx.output_format == "pcm_f32le" else to_s16le(audio)
        if self.binary:
            await self.send(data)
        else:
            await self.send({"type": "audio", "context_id": ctx.context_id, "audio": base64.b64encode(data).decode(),
                             "frame_start": frame_start, "num_frames": num_frames})


def _context_id(raw: str) -> str | None:
    try:
        value = json.loads(raw).get("context_id")
        return value if isinstance(value, str) else None
    except (ValueError, AttributeError):
        return None


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.server
    await ws.accept()
    key = state.config.api_key
    if key and not (check_bearer(ws.headers.get("authorization", ""), key) or
                    ws.query_params.get("api_key") == key):
        await ws.send_text(json.dumps({"type": "error", "context_id": None, **APIError(
            401, "invalid or missing API key (Authorization: Bearer <key>, or ?api_key=)", "invalid_api_key").body()}))
        await ws.close(code=1008)
        return
    if not state.ready:
        await ws.send_text(json.dumps({"type": "error", "context_id": None, **APIError(
            503, "the model is still loading", "model_not_ready").body()}))
        await ws.close(code=1013)
        return
    conn = Connection(ws, state, ws.query_params.get("binary", "").lower() in ("1", "true", "yes"))
    worker = asyncio.create_task(conn.work_loop())
    try:
        await conn.receive_loop()
    except WebSocketDisconnect:
        pass
    finally:
        worker.cancel()  # cancels the running generation: its engine request is aborted
        try:
            await worker
        except (asyncio.CancelledError, Exception):
            pass
