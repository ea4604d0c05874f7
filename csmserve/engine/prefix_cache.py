"""The prompt-prefix cache's index: which prompt prefixes have their backbone KV kept on the device.

A prefix is the first n positions of a prompt (a stored voice's reference turn, a conversation's
earlier turns: Request.prefix_len). A request also names shorter candidates (Request.prefix_boundaries,
its context's turn boundaries): the longest cached one is used, so a conversation that grows by a turn
per request reuses the previous request's prefix and prefills only the turns added since. Its key is a hash of those frames (tokens and mask); its value
is the backbone KV of positions [0, n) (k and v [L, Hkv, n, hd]), held by the runner
(`ModelRunner.prefix_kv`, keyed the same). This index lives on the host and knows no torch: the
scheduler looks prefixes up at admission and decides stores and evictions; the runner only copies.

Bounded memory: LRU by bytes. An entry is immutable once stored; evicting it only drops the runner's
reference (`PrefixStore.evict`, in order with the stores), after any copy out of it in the same batch.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

DEFAULT_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}  # EngineConfig.prefix_cache_bytes = None


def default_prefix_cache_bytes(device_type: str) -> int:
    return DEFAULT_BYTES.get(device_type, DEFAULT_BYTES["cpu"])


def prefix_keys(tokens: np.ndarray, mask: np.ndarray, lengths: list[int], adapter: int = 0) -> dict[int, bytes]:
    """The keys of the prefixes tokens[:n] / mask[:n] (frames [P, K+1]) for each n in `lengths`, hashed
    in one pass (a conversation's turn boundaries: the prompt is hashed once, not once per boundary).
    adapter: the LoRA adapter's id (engine/adapters.py; 0: the base model), part of every key."""
    rows = np.concatenate([tokens.astype(np.int64, copy=False), mask.astype(np.int64)], axis=1)  # [P, 2(K+1)]
    h = hashlib.blake2b(digest_size=16)
    h.update(int(tokens.shape[1]).to_bytes(8, "little"))
    if adapter:
        h.update(b"lora" + int(adapter).to_bytes(8, "little"))
    out, done = {}, 0
    for n in sorted(set(lengths)):
        h.update(np.ascontiguousarray(rows[done:n]).tobytes())
        done = n
        end = h.copy()
        end.update(int(n).to_bytes(8, "little"))
        out[n] = end.digest()
    return out


def prefix_key(tokens: np.ndarray, mask: np.ndarray, n: int) -> bytes:
    """The key of the prefix tokens[:n] / mask[:n]."""
    return prefix_keys(tokens, mask, [n])[n]


class PrefixCache:
    """key -> prefix length, least recently used first; `used_bytes` never exceeds `max_bytes`."""

    def __init__(self, max_bytes: int, bytes_per_position: int) -> None:
        if max_bytes < 0 or bytes_per_position < 1:
            raise ValueError(f"PrefixCache needs max_bytes >= 0 and bytes_per_position >= 1, "
                             f"got {max_bytes}, {bytes_per_position}")
        self.max_bytes, self.bytes_per_position = max_bytes, bytes_per_position
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._evicted: list[bytes] = []  # dropped from the index, not yet from the device
        self.used_bytes = 0
        self.stats = {"hits": 0, "misses": 0, "stores": 0, "evictions": 0, "hit_positions": 0}

    def nbytes(self, n: int) -> int:
        return n * self.bytes_per_position

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Least recently used first."""
        return list(self._entries)

    def lookup(self, key: bytes) -> int | None:
        """The prefix length if cached (and mark it most recently used), else None."""
        n = self._entries.get(key)
        if n is None:
            self.stats["misses"] += 1
            return None
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        self.stats["hit_positions"] += n
        return n

    def longest(self, candidates: list[tuple[bytes, int]]) -> tuple[bytes, int] | None:
        """The first cached (key, n) of `candidates` (longest first): one hit or one miss in the stats."""
        for key, _ in candidates:
            if key in self._entries:
                return key, self.lookup(key)
        self.stats["misses"] += 1
        return None

    def reserve(self, key: bytes, n: int) -> bool:
        """Make room for a new entry of n positions (evicting LRU entries) and index it. False when it
        is already there or larger than the whole cache: then nothing is to be stored."""
        size = self.nbytes(n)
        if key in self._entries or n < 1 or size > self.max_bytes:
            return False
        while self.used_bytes + size > self.max_bytes:
            old, old_n = self._entries.popitem(last=False)
            self.used_bytes -= self.nbytes(old_n)
            self._evicted.append(old)
            self.stats["evictions"] += 1
        self._entries[key] = n
        self.used_bytes += size
        self.stats["stores"] += 1
        return True

    def discard(self, key: bytes) -> None:
        """Drop `key` from the index (its store never ran: a failed step)."""
        n = self._entries.pop(key, None)
        if n is not None:
            self.used_bytes -= self.nbytes(n)

    def take_evicted(self) -> list[bytes]:
        """Keys evicted since the last call; the runner drops their tensors."""
        out, self._evicted = self._evicted, []
        return out
