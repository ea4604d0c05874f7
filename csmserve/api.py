"""The offline Python API: `CSM(model).prompt(...)`, `CSM(model).generate(...)`.

For now `generate` runs the reference generator (batch 1, no graphs); the engine takes its place
behind the same signature later, and `.audio` is filled once the Mimi codec lands.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import reference
from .engine.request import SamplingParams
from .models.loader import load_csm
from .tokenizer import FRAME_MS, PromptSegment, load_tokenizer, prompt_frames

SAMPLE_RATE = 24_000
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class Segment:
    """A context turn: who spoke, what they said, and their audio as Mimi codes [frames, 32] or a waveform."""

    speaker: int
    text: str
    codes: np.ndarray | None = None  # [frames, 32] int
    audio: np.ndarray | None = None  # [samples] float at 24 kHz (needs the Mimi codec)


@dataclass
class GenerationResult:
    codes: np.ndarray  # [frames, 32] int64, the ending all-zero frame excluded
    audio: np.ndarray | None  # [frames * 1920] float32 at 24 kHz; None until the codec is loaded
    finish_reason: str  # "eos" | "length"
    seed: int
    sample_rate: int = SAMPLE_RATE

    @property
    def duration_s(self) -> float:
        return self.codes.shape[0] * FRAME_MS / 1000


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class CSM:
    """CSM-1B: `model` is a hub id, a local directory, `dummy` or `dummy-tiny`."""

    def __init__(self, model: str = "sesame/csm-1b", device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.config, self.model_dir = load_csm(model, self.device, self.dtype)
        self.tokenizer = load_tokenizer(self.model_dir)

    def _segments(self, context: Sequence[Segment]) -> list[PromptSegment]:
        out = []
        for seg in context:
            if seg.audio is not None and seg.codes is None:
                raise NotImplementedError("Segment(audio=...) needs the Mimi codec, not loaded yet; pass codes=")
            if seg.codes is not None:
                codes = np.asarray(seg.codes)
                if codes.size and (codes.min() < 0 or codes.max() >= self.config.audio_vocab_size):
                    raise ValueError(f"codes must be in [0, {self.config.audio_vocab_size})")
            out.append(PromptSegment(int(seg.speaker), seg.text, seg.codes))
        return out

    def prompt(self, text: str, speaker: int = 0, context: Sequence[Segment] = (),
               max_audio_length_ms: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prompt frames: tokens [T, 33] int64, mask [T, 33] bool (checked to leave room for the audio if given)."""
        max_frames = None if max_audio_length_ms is None else max_audio_length_ms // FRAME_MS
        return prompt_frames(self.tokenizer, self._segments(context), text, int(speaker), self.config.num_codebooks,
                             max_frames, self.config.max_seq_len)

    def generate(self, text: str, speaker: int = 0, context: Sequence[Segment] = (), temperature: float = 0.9,
                 top_k: int = 50, top_p: float = 1.0, seed: int | None = None,
                 max_audio_length_ms: int = 10_000) -> GenerationResult:
        """Speech for `text` as `speaker`, after `context`. temperature 0 = greedy; seed None = a random seed."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_audio_length_ms=max_audio_length_ms)
        tokens, mask = self.prompt(text, speaker, context, max_audio_length_ms)
        out = reference.generate(self.model, tokens, mask, params)
        return GenerationResult(codes=out.codes, audio=None, finish_reason=out.finish_reason, seed=out.seed)
