"""What a request asks of the sampler, and the constants the sampler's implementations share.

`SamplingParams` is checked here once (every layer builds it, none re-checks it); the noise hash's
mixing constants and the greedy threshold are the contract between the torch sampler
(models/sampler.py) and the Triton kernel (kernels/sampler.py).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from csmserve.config import FRAME_MS

MIX1, MIX2 = 0x7FEB352D, 0x5BD1E995  # < 2^31: products of 32-bit values stay inside int64
# the Gumbel noise spans < 21 (u in [2^-25, 1 - 2^-25]): below this temperature only logits within
# 21 * 1e-5 of the largest could be drawn instead of it, and a logit / 1e-5 overflows only past 3e33
GREEDY_BELOW = 1e-5

UNLIMITED_FRAMES = 2**40


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.9  # 0 = greedy
    top_k: int = 50  # <= 0 disables
    top_p: float = 1.0
    seed: int | None = None  # None: the engine draws one at admission
    # the whole request's audio (every segment of a long-form request together); None: no cap
    max_audio_length_ms: int | None = 10_000
    # long-form: one segment's (sentence's) audio at most; None: only the whole cap
    max_segment_length_ms: int | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError unless every value samples (the scheduler checks again at add)."""
        t, p = self.temperature, self.top_p
        if not (isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {t!r}")
        if not (isinstance(p, numbers.Real) and 0 < p <= 1):  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, numbers.Integral) or not -2**31 < self.top_k < 2**31:  # the kernel's int32
            raise ValueError(f"top_k must be an int32, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, numbers.Integral) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2^63), got {self.seed!r}")
        for name in ("max_audio_length_ms", "max_segment_length_ms"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Integral) or v < FRAME_MS):
                raise ValueError(f"{name} must be an int >= 80 (one frame), got {v!r}")

    @property
    def max_frames(self) -> int:
        """Frames the whole request may generate."""
        return UNLIMITED_FRAMES if self.max_audio_length_ms is None else self.max_audio_length_ms // FRAME_MS

    @property
    def segment_frames(self) -> int:
        """Frames one segment may generate (at most max_frames)."""
        seg = UNLIMITED_FRAMES if self.max_segment_length_ms is None else self.max_segment_length_ms // FRAME_MS
        return min(seg, self.max_frames)
