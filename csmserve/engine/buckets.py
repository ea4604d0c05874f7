"""Batch and token buckets: the shapes CUDA graphs are captured at (a batch pads to the next one)."""
from __future__ import annotations


def bucket_sizes(limit: int, smallest: int = 1, step: int = 256) -> list[int]:
    """Powers of two from `smallest` up to `step`, then every `step`, then `limit` itself. A batch of
    2,192 frame rows runs as 2,304, not 2,512: the pad was most of what admissions cost a step at 2,000
    streams (measured); a wave of admissions (80 prompts of 16 frames, 1,280 tokens) pads by at most
    255 prefill rows, not up to twice its size."""
    out, s = [], smallest
    while s < min(limit, step):
        out.append(s)
        s *= 2
    s = step
    while s < limit:
        out.append(s)
        s += step
    return out + [limit]
