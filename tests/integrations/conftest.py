"""A dummy-tiny csmserve (real uvicorn, in a thread) for the voice-agent integrations, and what its
routes hand the engine: each Request as built, and the frames each one streamed."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import Server  # noqa: E402

from csmserve.config import EngineConfig, ServerConfig  # noqa: E402

ENGINE = EngineConfig(max_slots=4, max_seq_len=1024, first_chunk_frames=1, chunk_frames=2)
EOS_TEXT = 257  # dummy-tiny's byte tokenizer: bos 256, eos 257


class Built:
    """A Request as the route built it (the engine rewrites tokens and segments as it runs)."""

    def __init__(self, request) -> None:
        self.request_id = request.request_id
        self.tokens, self.mask = request.tokens.copy(), request.mask.copy()
        self.frames = 0  # frames it streamed (filled in as the stream runs)
        self.reason: str | None = None

    def turns(self) -> list[tuple[int, str, np.ndarray]]:
        """The prompt's turns: (speaker, text, audio codes [n, 32]); the last is the target (no codes)."""
        return prompt_turns(self.tokens, self.mask)


def prompt_turns(tokens: np.ndarray, mask: np.ndarray) -> list[tuple[int, str, np.ndarray]]:
    out, text, codes, i = [], [], [], 0
    while i < len(tokens):
        if mask[i, -1]:  # a text frame
            text.append(int(tokens[i, -1]))
            if text[-1] == EOS_TEXT:
                raw = bytes(t for t in text[1:-1]).decode()
                speaker, _, body = raw[1:].partition("]")
                out.append((int(speaker), body, np.zeros((0, 32), np.int64)))
                text = []
        else:  # audio frames of the last turn, up to its all-zero EOS frame
            if tokens[i, :32].any():
                codes.append(tokens[i, :32])
            else:
                out[-1] = (out[-1][0], out[-1][1], np.array(codes, np.int64).reshape(-1, 32))
                codes = []
        i += 1
    if text:  # the target turn (its text, no EOS audio)
        raw = bytes(t for t in text[1:-1]).decode()
        speaker, _, body = raw[1:].partition("]")
        out.append((int(speaker), body, np.zeros((0, 32), np.int64)))
    return out


@pytest.fixture(scope="session")
def csm():
    from csmserve import CSM

    c = CSM("dummy-tiny", device="cpu", dtype="float32", engine=True, engine_config=ENGINE)
    _ = c.client
    yield c
    c.close()


@pytest.fixture
def server(csm, tmp_path):
    """dummy-tiny never ends a sentence: without a cap from the client one stops at 2 s (--max-segment-ms),
    not the default 20 s, so a snippet run as the docs give it takes seconds."""
    from csmserve.server import create_app

    s = Server(create_app(csm, ServerConfig(voices_db=str(tmp_path / "voices.db"), default_audio_length_ms=400,
                                            max_segment_ms=2000, model_name="dummy-tiny"))).start()
    s.built = []  # every Request the routes started, as built
    s.chunk_delay = 0.0  # seconds each chunk is held back: generation at a known pace, whatever the CPU
    s.hold_after = 0  # > 0: after this many frames the stream waits for the client to leave (still generating)
    s.hold_only = None  # a request index: only that request is held
    stream = s.state.stream

    async def recording(request, *a, **kw):
        b = Built(request)
        s.built.append(b)
        try:
            async for chunk in stream(request, *a, **kw):
                b.frames += len(chunk.codes)
                if chunk.final:
                    b.reason = chunk.finish_reason
                if s.chunk_delay and len(chunk.codes):
                    await asyncio.sleep(s.chunk_delay)
                yield chunk
                held = s.hold_only is None or s.built.index(b) == s.hold_only
                if s.hold_after and held and b.frames >= s.hold_after and not chunk.final:
                    await asyncio.sleep(60)  # cancelled when the client goes away
        finally:
            b.reason = b.reason or "closed"  # left before its end (client gone, cancel): the engine aborts it

    s.state.stream = recording
    yield s
    s.stop()
