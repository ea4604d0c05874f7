"""When each reply's audio plays, for frameworks whose TTS does not hear back from the player (Pipecat):
in real time from when each piece of a reply's audio was handed on, after what plays already (an output
transport plays what it is given at once, at 1x: audio that comes after the player ran dry plays from
then). `played_ms(key)` at an interruption is how much of that reply was heard, in whole 80 ms frames.

    clock = Playout()
    clock.pushed("turn-1", frames=3)      # audio handed downstream: 3 frames of 80 ms
    clock.played_ms("turn-1")             # 0 .. 240, by the time since it started playing
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from csmserve.config import FRAME_MS


@dataclass
class _Run:
    # (when it starts playing, frames) per stretch handed on: audio pushed after the player ran dry plays from
    # when it came, not from where the reply's last audio ended
    pieces: list[list] = field(default_factory=list)

    @property
    def frames(self) -> int:
        return sum(n for _, n in self.pieces)


class Playout:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._runs: dict[str, _Run] = {}
        self._end = 0.0  # when the audio handed on so far ends playing

    def pushed(self, key: str, frames: int) -> None:
        """`frames` more frames of reply `key` were handed to the player."""
        run = self._runs.setdefault(key, _Run())
        start = max(self.clock(), self._end)  # after what plays already
        if run.pieces and start == self._end and run.pieces[-1][0] + run.pieces[-1][1] * FRAME_MS / 1000 == start:
            run.pieces[-1][1] += frames  # right after its own last piece: one stretch
        else:
            run.pieces.append([start, frames])
        self._end = start + frames * FRAME_MS / 1000

    def played_ms(self, key: str, now: float | None = None) -> int:
        """How much of reply `key` has played by now: whole frames, at most what was handed on."""
        run = self._runs.get(key)
        if run is None:
            return 0
        now = self.clock() if now is None else now
        return sum(max(0, min(n, int((now - t) * 1000 // FRAME_MS))) for t, n in run.pieces) * FRAME_MS

    def finished(self, key: str, now: float | None = None) -> bool:
        run = self._runs.get(key)
        return run is None or self.played_ms(key, now) >= run.frames * FRAME_MS

    def forget(self, key: str) -> None:
        self._runs.pop(key, None)

    def reset(self) -> None:
        """Playback stopped (an interruption): nothing queued plays any more."""
        self._runs.clear()
        self._end = 0.0
