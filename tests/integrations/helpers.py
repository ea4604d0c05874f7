"""Shared by the integration tests: user audio, greedy references, waiting for the engine or a condition, the
server's messages held on the wire."""
from __future__ import annotations

import asyncio
import time

import numpy as np

from csmserve.models import reference
from csmserve.audio import decode_audio_24k
from csmserve.sampling import SamplingParams
from csmserve.integrations.conversation import wav_bytes


def tone(seconds: float, rate: int = 16_000, hz: float = 220.0) -> bytes:
    """s16le mono: what a transport hands over as the user's audio."""
    t = np.arange(int(round(seconds * rate))) / rate
    return (0.4 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes()


def chunks(pcm: bytes, rate: int = 16_000, ms: int = 20) -> list[bytes]:
    n = rate * ms // 1000 * 2
    return [pcm[i:i + n] for i in range(0, len(pcm), n)]


def user_codes(csm, pcm: bytes, rate: int = 16_000) -> np.ndarray:
    """The codes the server gives the user's audio: the WAV it receives, decoded to 24 kHz, Mimi-encoded."""
    return csm.encode_audio(decode_audio_24k(wav_bytes(pcm, rate), 60.0))


def greedy(csm, text: str, speaker: int, context, frames: int) -> np.ndarray:
    tokens, mask = csm.prompt(text, speaker, context)
    return reference.generate(csm.model, tokens, mask, SamplingParams(temperature=0.0,
                                                                      max_audio_length_ms=frames * 80)).codes


def settle(csm, timeout: float = 10.0) -> None:
    """Every engine request finished and every slot free."""
    sched = csm.client.engine.scheduler
    deadline = time.time() + timeout
    while time.time() < deadline and (sched.has_unfinished() or sched.num_free_slots < sched.max_slots):
        time.sleep(0.02)
    assert not sched.has_unfinished() and sched.num_free_slots == sched.max_slots


def session_codes(server, context_id: str, role: str = "assistant", index: int = -1) -> np.ndarray:
    turns = [t for t in server.state.sessions.get(context_id).turns if t.role == role]
    return np.concatenate([s.codes for s in turns[index].segments]).astype(np.int64)


async def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


def hold_from(conv, kind: str) -> tuple[list[dict], callable]:
    """A Conversation reads the server's messages up to the first `kind` one; it and all after it wait (as if
    still on the wire) until release() hands them on in order."""
    held: list[dict] = []
    dispatch = conv._dispatch

    def reading(m: dict) -> None:
        if held or m.get("type") == kind:
            held.append(m)
        else:
            dispatch(m)

    def release() -> None:
        conv._dispatch = dispatch
        for m in held:
            dispatch(m)

    conv._dispatch = reading
    return held, release
