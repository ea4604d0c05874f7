"""Frozen configuration records, built once at the edge (cli / server) and copied field by field.

ModelConfig (backbone / depth / codec dims) and ServerConfig live here too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_slots: int = 64  # concurrent requests; a slot owns backbone KV, depth KV, sampler and codec rows
    max_waiting: int = 1024  # queued requests beyond the slots; past it add() raises SchedulerBusy
    max_seq_len: int = 2048  # backbone positions per slot: prompt frames + generated frames
    prefill_token_budget: int = 512  # prompt positions prefilled per engine step, over all slots
    max_prefill_chunk: int = 512  # prompt positions prefilled per step for one slot
    first_chunk_frames: int = 1  # frames in a request's first AudioChunk (time to first audio)
    chunk_frames: int = 4  # frames in each later AudioChunk

    def __post_init__(self) -> None:
        for name in ("max_slots", "max_seq_len", "prefill_token_budget", "max_prefill_chunk",
                     "first_chunk_frames", "chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"EngineConfig.max_waiting must be >= 0, got {self.max_waiting}")
