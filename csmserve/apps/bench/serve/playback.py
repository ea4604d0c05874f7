"""One stream as a listener hears it: when audio arrived, and whether a jitter buffer would have run dry.

Playback with a buffer of B seconds starts at the first audio + B and consumes real time. It runs dry
when, at some moment t, the audio received so far is less than what playback has reached, t - first - B.
The audio received is a step function that only rises at arrivals, so the worst moments are just before
each arrival of new audio: the stream's `worst_lag` = max over arrivals i of (t_i - first) - audio before
i, and it runs dry with buffer B iff worst_lag > B. One number per stream answers for every buffer.
"""
from __future__ import annotations


class Playback:
    __slots__ = ("t_first", "t_last", "audio", "first_audio", "worst_lag")

    def __init__(self) -> None:
        self.t_first: float | None = None  # the first audio's arrival
        self.t_last: float | None = None  # the last new audio's arrival
        self.audio = 0.0  # seconds received
        self.first_audio = 0.0  # seconds in the first arrival
        self.worst_lag = 0.0

    def arrive(self, t: float, audio: float) -> None:
        """At time t (seconds, monotonic) the stream holds `audio` seconds in all."""
        if audio <= self.audio:
            return
        if self.t_first is None:
            self.t_first, self.first_audio = t, audio
        else:
            lag = (t - self.t_first) - self.audio
            if lag > self.worst_lag:
                self.worst_lag = lag
        self.audio, self.t_last = audio, t

    @property
    def rate(self) -> float | None:
        """Seconds of audio per wall second after the first arrival (None: it all came at once)."""
        if self.t_first is None or self.t_last is None or self.t_last <= self.t_first:
            return None
        return (self.audio - self.first_audio) / (self.t_last - self.t_first)


def ran_dry(worst_lag: float, buffer_s: float) -> bool:
    return worst_lag > buffer_s
