"""A stand-in for `csmserve.CSM(..., engine=True)` with the same surface: the real engine and
dummy-tiny model, text tokenizer and prompt frames; audio is a tone derived from each frame's codes
(no Mimi), and encode_audio hashes 1920-sample frames to codes."""
from __future__ import annotations

import numpy as np

from csmserve.api import CSM
from csmserve.config import EngineConfig
from csmserve.engine.client import EngineClient
from csmserve.engine.engine import Engine
from csmserve.engine.runner import ModelRunner
from csmserve.models.loader import load_csm
from csmserve.prompt.tokenizer import load_tokenizer

FRAME = 1920


def tone(codes: np.ndarray) -> np.ndarray:
    # [n, 32] -> [n * 1920] float32: one sine per frame, its pitch from codebook 0
    t = np.arange(FRAME) / 24_000
    return np.concatenate([0.3 * np.sin(2 * np.pi * (200 + c[0] % 600) * t) for c in codes]).astype(np.float32) \
        if len(codes) else np.zeros(0, np.float32)


class ToneClient:
    """EngineClient whose chunks carry a tone for their codes."""

    def __init__(self, client: EngineClient) -> None:
        self.inner, self.engine = client, client.engine

    def append(self, request_id, tokens, mask):
        self.inner.append(request_id, tokens, mask)

    def close(self, request_id):
        self.inner.close(request_id)

    def stats(self):
        return self.inner.stats()

    @property
    def fatal(self):
        return self.inner.fatal

    async def astream(self, request, on_submit=None, max_lag_s=None):
        agen = self.inner.astream(request, on_submit=on_submit, max_lag_s=max_lag_s)
        try:
            async for chunk in agen:
                chunk.audio = tone(chunk.codes)
                yield chunk
        finally:
            await agen.aclose()


class FakeCSM:
    frame_size = FRAME
    sample_rate = 24_000

    def __init__(self, model: str = "dummy-tiny", engine_config: EngineConfig | None = None) -> None:
        self.model, self.config, model_dir = load_csm(model)
        self.tokenizer = load_tokenizer(model_dir)
        cfg = engine_config or EngineConfig(max_slots=32, max_seq_len=512)
        self.engine = Engine(ModelRunner(self.model, cfg.max_slots, cfg.max_seq_len), cfg)
        self.client = ToneClient(EngineClient(self.engine))
        self.max_seq_len = cfg.max_seq_len
        self.ready = True

    # CSM builds every request and prompt: the same builders here
    prompt, prompt_and_boundaries, _part, _room = CSM.prompt, CSM.prompt_and_boundaries, CSM._part, CSM._room
    request, long_request, segment_frames, history_overflow = (CSM.request, CSM.long_request, CSM.segment_frames,
                                                               CSM.history_overflow)

    def encode_audio(self, wav: np.ndarray) -> np.ndarray:
        n = max(1, len(wav) // FRAME)
        frames = np.resize(wav, n * FRAME).reshape(n, FRAME)
        seeds = (np.abs(frames).sum(axis=1) * 1e3).astype(np.int64)
        return np.stack([np.random.default_rng(int(s)).integers(0, 2048, 32) for s in seeds])

    def close(self) -> None:
        self.engine.shutdown()
