"""Where each segment (sentence, clause, dialogue line) starts and ends in a request's audio, exact,
from frame counts: one Mimi frame is 80 ms (1920 samples at 24 kHz), chunks never span two segments,
and `AudioChunk.segment_end` (or the final chunk) marks the chunk that ends one.

    clock = SegmentClock()
    for chunk in chunks:
        for span in clock.feed(chunk):   # the segments this chunk ended
            send({**span.fields(), ...})   # audio_start_ms, audio_end_ms, frame_start, num_frames ...
"""
from __future__ import annotations

from dataclasses import dataclass

from csmserve.engine.request import AudioChunk
from csmserve.config import FRAME_MS


@dataclass(frozen=True)
class SegmentSpan:
    segment: int  # index of the segment within the request
    frame_start: int  # its first frame within the request's audio
    num_frames: int
    finish_reason: str | None  # "eos" | "length" (| "abort" on a cut-off last one)

    def fields(self, speed: float = 1.0) -> dict:
        """The timing fields of an event: ms in the audio as sent (`speed` stretches it: ms / speed)."""
        scale = (lambda ms: ms) if speed == 1.0 else (lambda ms: round(ms / speed, 1))
        start_ms, end_ms = self.frame_start * FRAME_MS, (self.frame_start + self.num_frames) * FRAME_MS
        return {"segment": self.segment, "audio_start_ms": scale(start_ms), "audio_end_ms": scale(end_ms),
                "frame_start": self.frame_start, "num_frames": self.num_frames, "finish_reason": self.finish_reason}


class SegmentClock:
    """Feed a request's chunks in order; get back each segment as it ends."""

    def __init__(self) -> None:
        self._segment: int | None = None  # the segment being spoken
        self._start = 0  # its first frame
        self._frames = 0  # frames of the request so far
        self._ended = -1  # the last segment reported

    def feed(self, chunk: AudioChunk) -> list[SegmentSpan]:
        out: list[SegmentSpan] = []
        if chunk.segment <= self._ended and not len(chunk.codes):  # e.g. the empty final chunk after close
            return out
        if self._segment is not None and chunk.segment != self._segment:  # ended without a marker
            out.append(SegmentSpan(self._segment, self._start, self._frames - self._start, None))
            self._ended, self._segment = self._segment, None
        if self._segment is None:
            self._segment, self._start = chunk.segment, chunk.frame_start
        self._frames = chunk.frame_start + len(chunk.codes)
        end = chunk.segment_end or (chunk.finish_reason if chunk.final else None)
        if end is not None or chunk.final:
            out.append(SegmentSpan(self._segment, self._start, self._frames - self._start, end))
            self._ended, self._segment = self._segment, None
        return out
