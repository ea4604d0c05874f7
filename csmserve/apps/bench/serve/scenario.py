"""A load scenario: who sends what, when, and which window is measured.

    closed   C users; each sends a request and the next as soon as the last ends; users start spread
             over `ramp` s; then `warmup` s; then `duration` s measured (requests sent in the window)
    burst    C users, each one request, arriving evenly spread within `within` s (all measured)
    ws       C users on the WebSocket, each one connection and one context_id; per turn a sentence +
             flush, the next turn as soon as flush_done arrives (closed loop, windows as `closed`);
             `fresh=1`: a new context_id per turn (closed with `close`), no conversation carried

A spec on the command line is `MODE[:key=value,...]`, e.g. `closed:users=2048,format=pcm`,
`burst:users=2048,within=3`, `ws:users=1024,fresh=1`; keys not given take the global flags.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MODES = ("closed", "burst", "ws")
FORMATS = ("pcm", "mp3", "opus", "wav", "flac", "aac")


@dataclass(frozen=True)
class Scenario:
    mode: str = "closed"
    users: int = 64
    format: str = "pcm"  # ws: always binary pcm (s16le)
    ramp: float = 10.0
    warmup: float = 2.0
    duration: float = 20.0
    within: float = 3.0  # burst
    audio_ms: int = 10_000  # max_audio_length_ms per request / per turn's sentence
    voices: int = 0  # > 0: stored voices, user u speaks voice u % voices (prefix-cache affinity)
    fresh: bool = False  # ws: a new context_id per turn
    label: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"scenario mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users}")
        if min(self.ramp, self.warmup) < 0 or self.duration <= 0 or self.within < 0:
            raise ValueError("ramp and warmup must be >= 0, duration > 0, within >= 0")
        if self.audio_ms < 80:
            raise ValueError(f"audio_ms must be >= 80 (one frame), got {self.audio_ms}")
        if self.voices < 0:
            raise ValueError(f"voices must be >= 0, got {self.voices}")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        what = "ws" + (" fresh" if self.fresh else "") if self.mode == "ws" else self.format
        extra = f" in {self.within:g}s" if self.mode == "burst" else ""
        voices = f" {self.voices}v" if self.voices else ""
        return f"{self.mode} {self.users} {what}{extra}{voices}"

    def window(self, t_start: float) -> tuple[float, float]:
        """The measured window [t0, t1): requests sent in it are counted."""
        if self.mode == "burst":
            return t_start, t_start + max(self.within, 1e-3)
        t0 = t_start + self.ramp + self.warmup
        return t0, t0 + self.duration

    def start_offset(self, user: int) -> float:
        """When user `user` starts (closed/ws) or arrives (burst), after the scenario's start."""
        span = self.within if self.mode == "burst" else self.ramp
        return span * user / self.users

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TYPES = {f.name: f.type for f in dataclasses.fields(Scenario)}


def parse_scenario(spec: str, defaults: Scenario) -> Scenario:
    mode, _, rest = spec.partition(":")
    kw: dict = {"mode": mode.strip() or defaults.mode}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _TYPES or key == "mode":
            raise ValueError(f"scenario {spec!r}: expected key=value with key one of "
                             f"{', '.join(k for k in _TYPES if k != 'mode')}, got {item!r}")
        kw[key] = _parse_value(_TYPES[key], value.strip(), spec)
    return dataclasses.replace(defaults, **kw)


def _parse_value(type_name: str, value: str, spec: str):
    try:
        if type_name == "int":
            return int(value)
        if type_name == "float":
            return float(value)
        if type_name == "bool":
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return value
    except ValueError:
        raise ValueError(f"scenario {spec!r}: {value!r} is not a valid {type_name}") from None
