"""Pitch-preserving time-stretch for OpenAI's `speed` (0.25-4.0), streamed through libav's `atempo`."""
from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from av.filter import Graph

MIN_SPEED, MAX_SPEED = 0.25, 4.0


def check_speed(speed: float) -> float:
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
    return float(speed)


def _atempo_factors(speed: float) -> list[float]:
    # one atempo instance takes 0.5..2.0 (WSOLA quality drops beyond); chain them for 0.25..4.0
    factors = []
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return factors + [speed]


def av_frame(pcm: np.ndarray, sample_rate: int, pts: int) -> av.AudioFrame:
    """[n] float32 -> a mono libav frame starting at sample `pts` (time base 1/sample_rate)."""
    frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = sample_rate, pts, Fraction(1, sample_rate)
    return frame


class TimeStretch:
    """Streaming tempo change: write() returns what the filter has ready (it lags ~1-2 chunks),
    flush() the tail. Output length ~ input length / speed; pitch is kept."""

    def __init__(self, sample_rate: int, speed: float) -> None:
        self.sample_rate = sample_rate
        self.num_in = 0  # samples pushed, used as pts
        self.graph = Graph()
        tb = Fraction(1, sample_rate)
        nodes = [self.graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono", time_base=tb)]
        nodes += [self.graph.add("atempo", f"{f:.6f}") for f in _atempo_factors(check_speed(speed))]
        nodes.append(self.graph.add("abuffersink"))
        self.graph.link_nodes(*nodes).configure()

    def write(self, pcm: np.ndarray) -> np.ndarray:
        # pcm: [n] float32 -> [m] float32, m varies per call
        if pcm.size:
            self.graph.push(av_frame(pcm, self.sample_rate, self.num_in))
            self.num_in += pcm.size
        return self._pull()

    def flush(self) -> np.ndarray:
        self.graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                out.append(self.graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):  # EAGAIN: needs more input; EOF: after flush
                break
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
