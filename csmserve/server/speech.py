"""POST /v1/audio/speech: OpenAI's speech endpoint, streamed while the engine generates.

The first chunk is awaited before the response starts, so an error up to the first audio still gets its HTTP
status; after that an error ends the stream (an SSE `error` event, or in audio mode a body cut short), logged.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from functools import partial

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from csmserve.audio import MEDIA_TYPES, Encoder
from csmserve.config import FRAME_SAMPLES, SAMPLE_RATE
from csmserve.engine import trace
from csmserve.engine.request import AudioChunk
from csmserve.server import openapi
from csmserve.server.errors import APIError
from csmserve.server.lead import Lead
from csmserve.server.schemas import SpeechRequest, check_json_type, parse_body
from csmserve.server.state import Script, ServerState
from csmserve.server.timestamps import SegmentClock

log = logging.getLogger("csmserve.server")
router = APIRouter()
# a heavy encoder's (mp3, opus, aac, flac) turn in the EncodeQueue: at most 2 frames of audio (~1 ms of LAME)
ENCODE_PIECE_SAMPLES = 2 * FRAME_SAMPLES


class ClosingStreamingResponse(StreamingResponse):
    """Always closes the body iterator, however the response ends, so the engine request is aborted at once,
    not at garbage collection. A write that stalls longer than `stall_s` ends the response."""

    stall_s: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message) -> None:
            await asyncio.wait_for(send(message), self.stall_s)

        try:
            await super().__call__(scope, receive, send if self.stall_s is None else timed_send)
        except TimeoutError:
            log.warning("a client stopped reading for %.0f s: its response was ended", self.stall_s)
        finally:
            await self.body_iterator.aclose()


@router.post("/v1/audio/speech", openapi_extra=openapi.json_body(SpeechRequest), responses=openapi.SPEECH_RESPONSES,
             response_class=StreamingResponse)
async def create_speech(http: Request) -> StreamingResponse:
    """Speech for `input` in `voice`: audio (`response_format`) streamed as generated, or SSE events."""
    arrival = time.perf_counter()
    state: ServerState = http.app.state.server
    check_json_type(http.headers.get("content-type"))
    body = await parse_body(await http.body(), SpeechRequest)  # parsed here, not by FastAPI: see schemas.py
    plan = await state.plan(body)  # checked, voices and context resolved, the Request built
    request, encoder = plan.request, plan.encoder()
    chunks = state.stream(request, arrival)
    first = await _first_or_gone(chunks, http)
    headers = {"X-Request-Id": request.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if body.stream_format == "sse":
        timing = _Timing(plan.script, plan.spans, body.speed, dialogue=plan.dialogue, enabled=body.add_timestamps)
        content = _sse(chunks, first, encoder, request.prompt_len, request.request_id, timing, state.lead,
                       body.speed, state.encode_pool)
        response = ClosingStreamingResponse(content, media_type="text/event-stream", headers=headers)
    else:
        media_type = MEDIA_TYPES[body.response_format] + (";rate=24000" if body.response_format == "pcm" else "")
        audio = _audio(chunks, first, encoder, request.request_id, state.lead, body.speed, state.encode_pool)
        response = ClosingStreamingResponse(audio, media_type=media_type, headers=headers)
    response.stall_s = state.config.max_reader_lag_s
    return response


async def _first_or_gone(chunks: AsyncIterator[AudioChunk], http: Request) -> AudioChunk | None:
    """The first chunk (errors up to it still get their status); a client that leaves while its request
    waits for a slot aborts it there (it leaves the queue at once, never taking a slot)."""
    first = asyncio.ensure_future(anext(chunks))
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not first.done():
        first.cancel()
        try:
            await first
        except (asyncio.CancelledError, StopAsyncIteration):
            pass
        await chunks.aclose()
        raise ClientDisconnect()
    try:
        return first.result()
    except StopAsyncIteration:
        return None


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":  # the body is read: only the disconnect comes
        pass


async def _encode(encoder: Encoder, chunk: AudioChunk | None, lead: Lead, deadline: float,
                  pool: Executor | None = None) -> bytes:
    """Encode one chunk (None: close). A heavy encoder's turn comes from `pool` if given, else the worker's
    EncodeQueue, most urgent `deadline` first, in pieces of ENCODE_PIECE_SAMPLES at their own playback deadlines:
    a new request's first chunk waits for one piece, not for a second of another stream's audio."""
    work = encoder.close if chunk is None else partial(encoder.write, chunk.audio)
    if not encoder.heavy:
        return work()
    if pool is not None:
        return await asyncio.get_running_loop().run_in_executor(pool, work)
    if chunk is None or chunk.audio.size <= ENCODE_PIECE_SAMPLES:
        return await lead.queue.run(deadline, work)
    audio, parts = chunk.audio, []
    for i in range(0, audio.size, ENCODE_PIECE_SAMPLES):
        parts.append(await lead.queue.run(deadline + i / SAMPLE_RATE, encoder.write, audio[i:i + ENCODE_PIECE_SAMPLES]))
    return b"".join(parts)


async def _encoded(chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, encoder: Encoder, lead: Lead,
                   speed: float = 1.0, pool: Executor | None = None) -> AsyncIterator[tuple[bytes, AudioChunk | None]]:
    # -> (bytes, the chunk they encode); the encoder's tail last, with None. A chunk's deadline: when playback
    # would reach it (the first: now, never in `pool`). A stream far ahead of real time may wait (server/lead.py)
    try:
        t_first = time.monotonic()
        audio_s = 0.0
        if first is not None:
            yield await _encode(encoder, first, lead, t_first), first
            audio_s = first.audio.size / SAMPLE_RATE / speed
            async for chunk in chunks:
                await lead.wait(t_first, audio_s)
                yield await _encode(encoder, chunk, lead, t_first + audio_s, pool), chunk
                audio_s += chunk.audio.size / SAMPLE_RATE / speed
        yield await _encode(encoder, None, lead, t_first + audio_s, pool), None
    finally:
        await chunks.aclose()


async def _audio(chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, encoder: Encoder,
                 request_id: str, lead: Lead, speed: float, pool: Executor | None = None) -> AsyncIterator[bytes]:
    encoded = _encoded(chunks, first, encoder, lead, speed, pool)
    tr = trace.current()
    try:
        async for data, _ in encoded:
            if data:
                if tr is not None:  # the first bytes handed to the response: the request's record is complete
                    tr.done(request_id, written=time.perf_counter())
                    tr = None
                yield data
    except APIError as e:
        log.error("speech %s failed after streaming began: %s", request_id, e.message)
        raise
    except Exception:
        log.exception("speech %s failed after streaming began", request_id)
        raise
    finally:
        await encoded.aclose()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Timing:
    """`speech.audio.segment` events: where each segment starts and ends in the audio, what it says, who says it."""

    def __init__(self, script: Script, spans: list[tuple[int, int]] | None, speed: float, dialogue: bool,
                 enabled: bool) -> None:
        self.script, self.spans, self.speed, self.dialogue, self.enabled = script, spans, speed, dialogue, enabled
        self.clock = SegmentClock()

    def events(self, chunk: AudioChunk) -> list[dict]:
        out = []
        for span in self.clock.feed(chunk):
            i = span.segment
            ev = {"type": "speech.audio.segment", **span.fields(self.speed)}
            if i < len(self.script.texts):
                ev["text"] = self.script.texts[i]
                ev["speaker"] = self.script.speakers[i]
                if self.dialogue:
                    ev["line"] = self.script.lines[i]
                if self.spans is not None:
                    ev["text_start"], ev["text_end"] = self.spans[i]
            out.append(ev)
        return out


async def _sse(chunks: AsyncIterator[AudioChunk], first: AudioChunk | None, encoder: Encoder, prompt_len: int,
               request_id: str, timing: _Timing, lead: Lead, speed: float, pool: Executor | None = None
               ) -> AsyncIterator[str]:
    frames = 0
    encoded = _encoded(chunks, first, encoder, lead, speed, pool)
    tr = trace.current()
    try:
        async for data, chunk in encoded:
            if data:
                if tr is not None:
                    tr.done(request_id, written=time.perf_counter())
                    tr = None
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            if chunk is not None:
                frames += len(chunk.codes)
                for ev in timing.events(chunk) if timing.enabled else ():
                    yield _event(ev)
        yield _event({"type": "speech.audio.done",
                      "usage": {"input_tokens": prompt_len, "output_tokens": frames,
                                "total_tokens": prompt_len + frames}})
    except Exception as e:
        error = e if isinstance(e, APIError) else APIError(500, f"generation failed: {e}", "generation_failed")
        if isinstance(e, APIError):
            log.error("speech %s failed after streaming began: %s", request_id, e.message)
        else:
            log.exception("speech %s failed after streaming began", request_id)
        yield _event({"type": "error", **error.body()})
    finally:
        await encoded.aclose()
