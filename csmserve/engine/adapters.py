"""Which LoRA adapters the engine serves and which of them sit in the GPU pool's slots: the CPU-side policy.

Plain Python and numpy; no torch (the scheduler's side). An adapter is registered by name (`add`: its weights already read and
packed, models/lora.py, kept on the host) and gets a fresh id (the prefix cache keys on it: a name loaded again is
another adapter). The pool has `max_loras` GPU slots (models/lora.py LoraPool); the runner copies an adapter into a
slot between steps (`take_loads` -> the copies; `loaded` once one is done) and the scheduler admits a request only
once its adapter's copy is done (`want`), so no step waits for a load. A slot is pinned while admitted requests use
its adapter (`pin` / `unpin`); unpinned ones stay resident, least recently used first to go when another adapter
needs a slot (never one a queued request waits for). When every slot is pinned or loading, requests for a
non-resident adapter wait in the queue, at most EngineConfig.max_lora_wait_s (then AdapterPoolFullError).

Unloading (`remove`) takes the name away at once (new requests for it are refused as unknown; the name may be
loaded again); the requests already queued or running with it finish with it, and its slot and host copy are freed
once the last of them ends.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class UnknownAdapterError(ValueError):
    """A request for an adapter the engine does not serve (never loaded, or unloaded)."""


class AdapterLimitError(ValueError):
    """One adapter more than max_cpu_loras would be registered (unload one first)."""


class AdapterExistsError(ValueError):
    """An adapter of that name is loaded already (unload it first)."""


class AdapterPoolFullError(RuntimeError):
    """A request waited max_lora_wait_s for its adapter's GPU pool slot: every slot was held by running requests of
    other adapters (retry, or raise max_loras)."""


@dataclass(eq=False)
class Adapter:
    """A registered adapter: its host weights (opaque here: models/lora.py's LoraAdapter) and where it is."""

    id: int  # unique per registration
    name: str
    rank: int
    nbytes: int
    weights: Any
    path: str = ""
    slot: int = -1  # its GPU slot, -1: not resident
    ready: bool = False  # resident and its copy done
    refs: int = 0  # requests queued or running with it
    pins: int = 0  # admitted requests (their rows read its slot)
    waiting: int = 0  # queued requests parked until it is resident
    removed: bool = False  # unloaded: freed once refs == 0
    stats: dict = field(default_factory=lambda: {"requests": 0, "frames": 0, "loads": 0, "load_s": 0.0})
    _load_t0: float = 0.0

    def info(self) -> dict:
        """name, rank, bytes, where it is and how much it is used (for listings and metrics): requests (queued
        since it was loaded), frames (generated with it), loads (copies into the pool), load_s (their time)."""
        return {"name": self.name, "id": self.id, "rank": self.rank, "bytes": self.nbytes, "path": self.path,
                "resident": self.ready, "running": self.pins, "queued": self.refs - self.pins, **self.stats}


class AdapterSlots:
    def __init__(self, max_loras: int, max_adapters: int) -> None:
        if max_loras < 1 or max_adapters < 1:
            raise ValueError(f"AdapterSlots needs max_loras >= 1 and max_adapters >= 1, got {max_loras}, "
                             f"{max_adapters}")
        self.max_loras, self.max_adapters = max_loras, max_adapters
        self.by_name: dict[str, Adapter] = {}
        self.live: dict[int, Adapter] = {}  # id -> every adapter not yet freed (the unloaded ones still in use too)
        self.slots: list[Adapter | None] = [None] * max_loras
        self.idle: OrderedDict[int, None] = OrderedDict()  # resident, ready, unpinned slots; least recently used first
        self._loads: list[tuple[int, Adapter]] = []  # copies for the runner to start
        self._ids = itertools.count(1)

    # ---- the registry
    def add(self, name: str, weights: Any, rank: int, nbytes: int, path: str = "") -> Adapter:
        if not name or not isinstance(name, str):
            raise ValueError("an adapter needs a non-empty name")
        if name in self.by_name:
            raise AdapterExistsError(f"adapter {name!r} is already loaded (unload it first)")
        if len(self.live) >= self.max_adapters:
            raise AdapterLimitError(f"{len(self.live)} adapters loaded, the most there may be (max_cpu_loras = "
                                    f"{self.max_adapters}): unload one first")
        a = Adapter(next(self._ids), name, rank, nbytes, weights, path)
        self.by_name[name] = self.live[a.id] = a
        return a

    def get(self, name: str) -> Adapter:
        a = self.by_name.get(name)
        if a is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: {known})")
        return a

    def remove(self, name: str) -> Adapter:
        """Unload: the name is gone now; the adapter is freed once its requests end (at once if it has none)."""
        a = self.get(name)
        del self.by_name[name]
        a.removed = True
        if a.refs == 0:
            self._free(a)
        return a

    def info(self) -> dict[str, dict]:
        return {name: a.info() for name, a in self.by_name.items()}

    # ---- requests
    def ref(self, a: Adapter) -> None:
        """A request with this adapter was queued."""
        a.refs += 1
        a.stats["requests"] += 1

    def unref(self, a: Adapter, pinned: bool) -> None:
        """That request ended (pinned: it had been admitted)."""
        if pinned:
            self.unpin(a)
        a.refs -= 1
        if a.removed and a.refs == 0:
            self._free(a)

    def want(self, a: Adapter) -> bool:
        """True if the adapter's slot is ready (admit its request now); else its copy is under way, or is started
        now into a free slot or the least recently used idle one, or every slot is taken (the request waits)."""
        if a.ready:
            return True
        if a.slot >= 0:  # loading
            return False
        slot = next((i for i, s in enumerate(self.slots) if s is None), None)
        if slot is None:
            slot = next((s for s in self.idle if self.slots[s].waiting == 0), None)  # never one a request waits for
            if slot is None:
                return False
            old = self.slots[slot]
            del self.idle[slot]
            old.slot, old.ready = -1, False
        self.slots[slot] = a
        a.slot, a.ready = slot, False
        a._load_t0 = time.perf_counter()
        self._loads.append((slot, a))
        return False

    def pin(self, a: Adapter) -> int:
        """An admitted request's rows read the adapter's slot (it must be ready) -> the slot."""
        assert a.ready, f"adapter {a.name!r} admitted before its copy was done"
        a.pins += 1
        self.idle.pop(a.slot, None)
        return a.slot

    def unpin(self, a: Adapter) -> None:
        a.pins -= 1
        if a.pins == 0 and a.ready:
            self.idle[a.slot] = None  # the most recently used

    def count_frames(self, slots) -> None:
        """A step's frames, by the pool slot of each frame's row (numpy [n], -1: the base): into each adapter's."""
        counts = np.bincount(slots[slots >= 0], minlength=self.max_loras)
        for slot in np.flatnonzero(counts):  # the adapters in the step, not its rows
            a = self.slots[slot]
            if a is not None:
                a.stats["frames"] += int(counts[slot])

    # ---- the runner's side
    def take_loads(self) -> list[tuple[int, Adapter]]:
        """The copies to start now: (slot, adapter)."""
        loads, self._loads = self._loads, []
        return loads

    def loaded(self, slot: int, a: Adapter) -> None:
        """The copy of `a` into slot is done: it is ready (unless the slot went to another adapter meanwhile)."""
        if self.slots[slot] is not a or a.ready:
            return
        a.ready = True
        a.stats["loads"] += 1
        a.stats["load_s"] += time.perf_counter() - a._load_t0
        if a.pins == 0:
            self.idle[slot] = None

    def _free(self, a: Adapter) -> None:
        self.live.pop(a.id, None)
        if a.slot >= 0 and self.slots[a.slot] is a:
            self.idle.pop(a.slot, None)
            self._loads = [(s, x) for s, x in self._loads if x is not a]
            self.slots[a.slot] = None
        a.slot, a.ready, a.weights = -1, False, None
