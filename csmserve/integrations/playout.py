"""When each reply's audio plays, for frameworks whose TTS does not hear back from the player (Pipecat):
in real time from when the reply's first audio was handed on, each reply after the one before it (an
output transport plays what it is given at once, at 1x). `played_ms(key)` at an interruption is how
much of that reply was heard, in whole 80 ms frames.

    clock = Playout()
    clock.pushed("turn-1", frames=3)      # audio handed downstream: 3 frames of 80 ms
    clock.played_ms("turn-1")             # 0 .. 240, by the time since it started playing
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from csmserve.config import FRAME_MS


@dataclass
class _Run:
    start: float  # when its first frame started playing
    frames: int = 0  # frames handed on


class Playout:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._runs: dict[str, _Run] = {}
        self._end = 0.0  # when the audio handed on so far ends playing

    def pushed(self, key: str, frames: int) -> None:
        """`frames` more frames of reply `key` were handed to the player."""
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run(max(self.clock(), self._end))
        run.frames += frames
        self._end = max(self._end, run.start + run.frames * FRAME_MS / 1000)

    def played_ms(self, key: str, now: float | None = None) -> int:
        """How much of reply `key` has played by now: whole frames, at most what was handed on."""
        run = self._runs.get(key)
        if run is None:
            return 0
        now = self.clock() if now is None else now
        frames = max(0, min(run.frames, int((now - run.start) * 1000 // FRAME_MS)))
        return frames * FRAME_MS

    def finished(self, key: str, now: float | None = None) -> bool:
        run = self._runs.get(key)
        return run is None or self.played_ms(key, now) >= run.frames * FRAME_MS

    def forget(self, key: str) -> None:
        self._runs.pop(key, None)

    def reset(self) -> None:
        """Playback stopped (an interruption): nothing queued plays any more."""
        self._runs.clear()
        self._end = 0.0
