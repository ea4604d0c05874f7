"""The CPU-only policy: admission into slots, chunked prefill under a token budget, finish, abort.

Plain Python and numpy; no torch. One engine step:

    batch = scheduler.schedule()          # admissions, prefill chunks, frame-step slots
    runner.run(batch)                     # launched; no host sync inside the frame
    scheduler.update(prev.step, codes)    # the PREVIOUS step's codes [len(prev.decode_slots), 32]

Results arrive one step late, so a slot may have one more frame in flight after its request
ended (EOS, length, abort) and may already belong to a new request when that frame comes
back. Every scheduled step records which request owned each of its decode slots, and
update() drops rows whose owner has finished. The length limit is enforced when scheduling
(num_scheduled_frames), so no frame past it is ever computed.
"""
from __future__ import annotations

import dataclasses
import heapq
import secrets
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from csmserve.config import EngineConfig
from csmserve.engine.request import Admission, Batch, PrefillChunk, Request, RequestStatus


class SchedulerBusy(RuntimeError):
    """The waiting queue is full; the caller should answer 'busy' (HTTP 503/429) and not retry at once."""


class RequestOutput(NamedTuple):  # a NamedTuple: one per running slot per step, cheap to build
    """What one step produced for one request."""

    request: Request
    row: int  # row of this request in its step's codes (and PCM): index into batch.decode_slots
    codes: np.ndarray  # [n, 32] int64, n in {0, 1}; n = 0 when the step only brought the EOS frame
    frame_start: int  # index of codes[0] within the request's generated frames
    finish_reason: str | None  # "eos" | "length" when this output ends the request

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, slots=True)
class _Step:
    step: int
    owners: list[tuple[int, Request]]  # (slot, request) for each decode row, at scheduling time


class Scheduler:
    def __init__(self, config: EngineConfig, num_codebooks: int = 32) -> None:
        self.num_codebooks = num_codebooks
        self.max_slots = config.max_slots
        self.max_waiting = config.max_waiting
        self.max_seq_len = config.max_seq_len
        self.prefill_token_budget = config.prefill_token_budget
        self.max_prefill_chunk = config.max_prefill_chunk
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()  # admitted, prompt KV not complete; FIFO
        self.slots: list[Request | None] = [None] * config.max_slots  # owner of each slot
        self.running: dict[int, Request] = {}  # slot -> request whose prefill is complete
        self._limits: list[int] = [0] * config.max_slots  # frame_limit of each slot's request
        self._free: list[int] = list(range(config.max_slots))  # heap: lowest free slot first
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._inflight: deque[_Step] = deque()  # scheduled frame steps whose codes are not back
        self._step = 0

    # ---- counts (metrics, idle checks)
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_prefilling(self) -> int:
        return len(self.prefilling)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- inbox
    def add(self, req: Request) -> None:
        """Queue a request. Raises SchedulerBusy past max_waiting, ValueError for a bad request."""
        self._validate(req)
        if len(self.waiting) >= self.max_waiting:
            raise SchedulerBusy(f"server busy: {len(self.waiting)} requests already waiting (max_waiting)")
        self.waiting.append(req)
        self._requests[req.request_id] = req

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted; its slot is free for the next schedule(). None if not live."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    # ---- policy
    def schedule(self) -> Batch:
        self._step += 1
        admissions = [self._admit(self.waiting.popleft()) for _ in range(min(len(self.waiting), len(self._free)))]
        prefills = self._schedule_prefills()
        owners = [(slot, req) for slot, req in sorted(self.running.items())
                  if req.num_scheduled_frames < self._limits[slot]]
        for _, req in owners:
            req.num_scheduled_frames += 1
        if owners:
            self._inflight.append(_Step(self._step, owners))
        return Batch(admissions, prefills, [slot for slot, _ in owners], step=self._step)

    def update(self, step: int, codes: np.ndarray) -> list[RequestOutput]:
        """Take step `step`'s codes [len(decode_slots), 32], rows in batch.decode_slots order."""
        owners = self._inflight_owners(step)
        if codes.shape[0] != len(owners):
            raise ValueError(f"step {step}: {codes.shape[0]} rows of codes for {len(owners)} decode slots")
        if owners:
            self._inflight.popleft()
        codes = np.array(codes, dtype=np.int64)  # our own copy: the runner reuses its host buffer
        is_eos = (~codes.any(axis=1)).tolist()  # the all-zero frame ends the utterance
        return [self._append(row, req, codes[row:row + 1], is_eos[row])
                for row, (_, req) in enumerate(owners) if req.status is RequestStatus.RUNNING]

    def frame_limit(self, req: Request) -> int:
        # the frame step for frame k runs at position prompt_len - 1 + k, inside max_seq_len
        return min(req.params.max_frames, self.max_seq_len - req.prompt_len + 1)

    # ---- helpers
    def _validate(self, req: Request) -> None:
        if req.status != RequestStatus.WAITING or req.request_id in self._requests:
            raise ValueError(f"request {req.request_id} was already added")
        w = self.num_codebooks + 1
        if req.tokens.ndim != 2 or req.tokens.shape[1] != w or req.mask.shape != req.tokens.shape:
            raise ValueError(f"prompt must be tokens/mask [P, {w}], got {req.tokens.shape} / {req.mask.shape}")
        if not 1 <= req.prompt_len <= self.max_seq_len:
            raise ValueError(f"prompt is {req.prompt_len} frames; it must be 1..{self.max_seq_len} (max_seq_len)")

    def _admit(self, req: Request) -> Admission:
        slot = heapq.heappop(self._free)
        self.slots[slot] = req
        self._limits[slot] = self.frame_limit(req)
        req.slot = slot
        if req.params.seed is None:  # never share a noise stream with another unseeded request
            req.params = dataclasses.replace(req.params, seed=secrets.randbits(63))
        if req.num_to_prefill > 0:
            req.status = RequestStatus.PREFILLING
            self.prefilling.append(req)
        else:
            self._start_running(req)
        p = req.params
        return Admission(slot, req.tokens[-1], req.mask[-1], req.prompt_len - 1,
                         p.temperature, p.top_k, p.top_p, p.seed)

    def _schedule_prefills(self) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        budget = self.prefill_token_budget
        for req in list(self.prefilling):  # FIFO; a long prompt takes several steps
            if budget == 0:
                break
            n = min(req.num_to_prefill, budget, self.max_prefill_chunk)
            start = req.num_prefilled
            chunks.append(PrefillChunk(req.slot, start, req.tokens[start:start + n], req.mask[start:start + n]))
            req.num_prefilled += n
            budget -= n
            if req.num_to_prefill == 0:
                self.prefilling.remove(req)
                self._start_running(req)  # its first frame step runs in this same batch
        return chunks

    def _start_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running[req.slot] = req

    def _inflight_owners(self, step: int) -> list[tuple[int, Request]]:
        while self._inflight and self._inflight[0].step < step:  # a step whose codes were never read
            if any(req.status is RequestStatus.RUNNING for _, req in self._inflight[0].owners):
                raise RuntimeError(f"update({step}) but step {self._inflight[0].step}'s codes never came back")
            self._inflight.popleft()  # nobody waits for them (e.g. all aborted after a failed step)
        if not self._inflight or self._inflight[0].step > step:
            return []  # that step scheduled no frame
        return self._inflight[0].owners

    def _append(self, row: int, req: Request, frame: np.ndarray, is_eos: bool) -> RequestOutput:
        start = req.num_frames  # frame: [1, 32]
        if is_eos:  # not counted, not emitted
            self._finish(req, RequestStatus.FINISHED_EOS)
            return RequestOutput(req, row, frame[:0], start, "eos")
        req.num_frames += 1
        if req.num_frames >= self._limits[req.slot]:
            self._finish(req, RequestStatus.FINISHED_LENGTH)
        return RequestOutput(req, row, frame, start, req.status.finish_reason)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.PREFILLING:
            self.prefilling.remove(req)
        if req.slot is not None:
            self.slots[req.slot] = None
            self.running.pop(req.slot, None)
            heapq.heappush(self._free, req.slot)
            req.slot = None
        req.status = status
        del self._requests[req.request_id]
