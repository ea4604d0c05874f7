"""The CPU-only policy: admission into slots, chunked prefill under a token budget, finish, abort.

Plain Python and numpy; no torch. One engine step:

    batch = scheduler.schedule()          # admissions, prefill chunks, frame-step slots
    runner.run(batch)                     # launched; no host sync inside the frame
    rows = scheduler.update(prev.step, codes)   # the PREVIOUS step's codes [len(prev.decode_slots), 32]

Per-step work is vectorised over slots: the frame-step set, the frame counters, the end checks and
the rows handed back (`StepRows`) are numpy arrays indexed by slot; only requests that start, end or
change segment touch Python objects. Each slot carries a generation number bumped whenever its
owner or segment changes, so results arriving one step late for a request that ended (EOS, length,
abort, a segment end) are dropped by comparing generations, whoever owns the slot by then. The
length limit is enforced when scheduling (frames scheduled per segment), so no frame past it is
ever computed.

Limits per request (SamplingParams): `max_frames` caps the whole request, all segments together;
`segment_frames` caps one segment (long-form); both also stop where max_seq_len would be passed.

Long-form (Request.segments / Request.open): a request may carry several target turns, generated one
after another in its slot; each sees the earlier ones through the KV already there. When a segment
ends, the next prompt is prefilled from the slot's next free position and a resume (an Admission
that keeps the codec row and the frame counter) restarts the frame steps:
- ended on EOS: when the host reads the EOS frame, the next frame step (already launched) has
  consumed it as input and written its KV (the EOS frame of the context turn) and produced a junk
  frame, dropped by update(). If no such step ran (the EOS was the segment's last allowed frame),
  the EOS frame is prefilled first.
- ended on length: no step consumed the last frame, so [last frame, EOS frame] are prefilled first.
When the next segment would not fit in max_seq_len, the slot is prefilled again from position 0
with the newest segments that fit as context turns (text + generated codes + EOS), after the
request's own context if it fits; the oldest segments are dropped. The codec state is untouched.
A segment ending with no next segment yet on an open request leaves it IDLE: it holds its slot and
is not stepped until append_segment() brings text or close() ends it.

Prefix cache (Request.prefix_len, engine/prefix_cache.py): at admission, a prompt whose first
prefix_len positions, or failing that the longest of its Request.prefix_boundaries, are cached gets
`Admission.prefix_hit` (the runner copies that KV into the slot) and its prefill starts there. Unless
all of prefix_len was cached, once the prefill has written positions [0, prefix_len), the same batch
carries a `PrefixStore` (the runner copies the slot's KV[:, :prefix_len] out, after the evictions that
made room). A prefix never covers the prompt's last position. With a LoRA adapter the key is the adapter's and the
prompt's: its KV is the adapter's.

LoRA adapters (Request.adapter, engine/adapters.py): a request names a registered adapter (unknown: refused at add);
it is admitted only once that adapter sits in a GPU pool slot and its copy is done. Until then it is parked (it still
counts as waiting), and the adapter's copy is started as soon as a pool slot is free or idle; requests behind it with
another adapter, or none, go on. Its rows carry the pool slot (Admission.adapter, PrefillChunk.adapter), and a step's
rows are ordered by it (then by slot), so that the LoRA kernels' row tiles meet few adapters each.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from csmserve.config import EngineConfig
from csmserve.engine.adapters import Adapter, AdapterSlots
from csmserve.engine.prefix_cache import PrefixCache, prefix_keys
from csmserve.engine.request import (END_EOS, END_LENGTH, END_NONE, END_REASONS, Admission, Batch, PrefillChunk,
                                     PrefixStore, Request, RequestStatus)


class SchedulerBusy(RuntimeError):
    """The waiting queue is full; the caller should answer 'busy' (HTTP 503/429) and not retry at once."""


class RequestOutput(NamedTuple):
    """One row of a step, as a Python record (StepRows.outputs(): tests and per-row consumers)."""

    request: Request
    row: int  # row of this request in its step's codes (and PCM): index into batch.decode_slots
    codes: np.ndarray  # [n, 32] int64, n in {0, 1}; n = 0 when the step only brought the EOS frame
    frame_start: int  # index of codes[0] within the request's generated frames
    finish_reason: str | None  # "eos" | "length" when this output ends the request
    segment: int = 0  # long-form: the segment these codes belong to
    segment_end: str | None = None  # "eos" | "length" when this output ends its segment

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class StepRows:
    """What one frame step produced, one entry per live row, all arrays [M] (M <= decode slots)."""

    step: int
    rows: np.ndarray  # int64: row in the step's codes / PCM
    handles: np.ndarray  # int64: Request.handle of each row's request
    codes: np.ndarray  # [M, K] int64 (our copy)
    frame_start: np.ndarray  # int64: index of the row's frame within its request (EOS rows: the next index)
    segment: np.ndarray  # int64
    has_frame: np.ndarray  # bool: False for the all-zero EOS frame (not emitted)
    end: np.ndarray  # uint8: END_NONE / END_EOS / END_LENGTH: this row ends its segment
    final: np.ndarray  # bool: this row ends its request
    requests: np.ndarray | None = None  # [M] object: the rows' Request (scheduler side only; never sent)

    def __len__(self) -> int:
        return len(self.rows)

    def outputs(self) -> list[RequestOutput]:
        out = []
        for i, req in enumerate(() if self.requests is None else self.requests):
            reason = END_REASONS[self.end[i]]
            out.append(RequestOutput(req, int(self.rows[i]), self.codes[i:i + int(self.has_frame[i])],
                                     int(self.frame_start[i]), reason if self.final[i] else None,
                                     int(self.segment[i]), reason))
        return out


def empty_rows(step: int, num_codebooks: int) -> StepRows:
    z = np.zeros(0, np.int64)
    return StepRows(step, z, z, np.zeros((0, num_codebooks), np.int64), z, z, np.zeros(0, bool),
                    np.zeros(0, np.uint8), np.zeros(0, bool))


@dataclass(frozen=True, slots=True)
class _Step:
    step: int
    slots: np.ndarray  # [B] int64 decode slots in row order
    gen: np.ndarray  # [B] int64 their generations at scheduling time


@dataclass
class _SegmentFrames:
    """One segment of a long-form request in its slot: its text frames, then the codes it generated."""

    tokens: np.ndarray  # [n, K+1] the turn's text frames
    mask: np.ndarray
    codes: np.ndarray | None = None  # [frames, K] generated, set when the turn's segment ends


@dataclass
class _History:
    """What a long-form request's slot holds, to continue it and to rebuild it from position 0."""

    context: tuple[np.ndarray, np.ndarray] | None  # the request's own context turns (prompt[:context_len])
    segments: list[_SegmentFrames]  # its generated segments still in the slot, oldest first; the last is the current one
    tail: tuple[np.ndarray, np.ndarray] | None = None  # frames to prefill before the next segment's text
    next_pos: int = 0  # slot position of tail[0] (or of the next text when there is no tail)
    last_reason: str = "eos"  # how the last finished segment ended


class Scheduler:
    def __init__(self, config: EngineConfig, num_codebooks: int = 32, prefix_cache: PrefixCache | None = None,
                 adapters: AdapterSlots | None = None) -> None:
        self.num_codebooks = K = num_codebooks
        self.prefix_cache = prefix_cache  # None: no prefix caching
        self.adapters = adapters  # None: no LoRA adapters served
        self._parked: dict[Adapter, deque[Request]] = {}  # requests waiting for their adapter's slot, oldest first
        self._n_parked = 0
        self._pending_stores: dict[str, tuple[bytes, int]] = {}  # request id -> prefix to store once prefilled
        self._stores: list[PrefixStore] = []  # this step's
        if config.max_slots is None:
            raise ValueError("EngineConfig.max_slots is None: size it first (CSM does, from free GPU memory)")
        self.max_slots = N = config.max_slots
        self.max_waiting = config.max_waiting
        self.max_seq_len = config.max_seq_len
        self.prefill_token_budget = config.prefill_token_budget
        self.max_prefill_chunk = config.max_prefill_chunk
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()  # admitted, prompt KV not complete; FIFO
        self.slots: list[Request | None] = [None] * N  # owner of each slot
        self._free: list[int] = list(range(N))  # heap: lowest free slot first
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._inflight: deque[_Step] = deque()  # scheduled frame steps whose codes are not back
        self._history: dict[str, _History] = {}  # long-form requests
        self._resumes: list[Admission] = []  # continuations to load at the next schedule()
        self.first_from_prefill = config.first_frame_from_prefill
        self._step = 0
        # ---- per-slot arrays (the vectorised state of every running slot)
        self._stepping = np.zeros(N, bool)  # RUNNING and below its segment's limit: steps a frame
        self._running = np.zeros(N, bool)  # RUNNING (its prefill is complete)
        self._gen = np.zeros(N, np.int64)  # bumped when the slot's owner or segment changes
        self._handle = np.full(N, -1, np.int64)
        self._limit = np.zeros(N, np.int64)  # frames allowed in the current segment
        self._seg_scheduled = np.zeros(N, np.int64)  # frame steps scheduled in this segment
        self._seg_frames = np.zeros(N, np.int64)  # frames back in this segment (EOS excluded)
        self._num_frames = np.zeros(N, np.int64)  # frames back in the request (EOS excluded)
        self._segment = np.zeros(N, np.int64)
        self._owner = np.full(N, None, object)  # the Request of each slot (gathered per step without a loop)
        self._lora_slot = np.full(N, -1, np.int64)  # the LoRA pool slot each slot's rows read (-1: none)
        self._seg_codes = np.zeros((N, config.max_seq_len, K), np.int16)  # this segment's frames (long-form)

    # ---- counts (metrics, idle checks)
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self._n_parked

    @property
    def num_prefilling(self) -> int:
        return len(self.prefilling)

    @property
    def num_running(self) -> int:
        return int(self._running.sum())

    @property
    def num_idle(self) -> int:
        """Long-form requests holding a slot while they wait for their next segment's text."""
        return self.max_slots - len(self._free) - self.num_running - len(self.prefilling)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    @property
    def last_step(self) -> int:
        """The number of the last schedule()'s step (Batch.step)."""
        return self._step

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Something to schedule (idle long-form requests waiting for text are not work)."""
        return bool(self.waiting or self._parked or self.prefilling or self._stepping.any() or self._resumes)

    def frames_generated(self, req: Request) -> int:
        """Frames req has generated so far (Request.num_frames is only kept up to date when it ends)."""
        return int(self._num_frames[req.slot]) if req.slot is not None else req.num_frames

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ---- inbox
    def add(self, req: Request) -> None:
        """Queue a request. Raises SchedulerBusy past max_waiting, ValueError for a bad request."""
        self._validate(req)
        if self.num_waiting - len(self._free) >= self.max_waiting:  # those with a free slot are not queued
            raise SchedulerBusy(f"server busy: {self.num_waiting} requests already waiting (max_waiting)")
        if req.lora is not None:
            self.adapters.ref(req.lora)
        self.waiting.append(req)
        self._requests[req.request_id] = req

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted; its slot is free for the next schedule(). None if not live."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING:
            parked = self._parked.get(req.lora) if req.lora is not None else None
            if parked is not None and req in parked:
                parked.remove(req)
                self._n_parked -= 1
                req.lora.waiting -= 1
                if not parked:
                    del self._parked[req.lora]
            else:
                self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def append_segment(self, request_id: str, tokens: np.ndarray, mask: np.ndarray) -> Request | None:
        """Add a segment (text frames [n, K+1]) to an open long-form request; None if it is not live."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if not req.open:
            raise ValueError(f"request {request_id} is not open for more text")
        self._check_segment(tokens, mask)
        req.segments.append((tokens, mask))
        if req.status is RequestStatus.IDLE:
            self._start_next_segment(req, self._history[request_id])
        return req

    def close(self, request_id: str) -> Request | None:
        """No more segments for this request. Returns it if that finished it (it was idle), else None."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        req.open = False
        if req.status is RequestStatus.IDLE and not req.segments:
            reason = self._history[request_id].last_reason
            self._finish(req, RequestStatus.FINISHED_EOS if reason == "eos" else RequestStatus.FINISHED_LENGTH)
            return req
        return None

    # ---- policy
    def schedule(self) -> Batch:
        self._step += 1
        admissions = [self._admit(req) for req in self._admissible(len(self._free))]
        resumes, self._resumes = self._resumes, []
        prefills, done = self._schedule_prefills()
        stores, self._stores = self._stores, []
        slots = np.flatnonzero(self._stepping)  # [B] sorted
        if self.adapters is not None and len(slots) > 1:  # by adapter pool slot (-1 first), then slot
            slots = slots[np.argsort(self._lora_slot[slots], kind="stable")]
        first = False
        if len(slots):
            sched = self._seg_scheduled[slots] + 1
            self._seg_scheduled[slots] = sched
            self._stepping[slots[sched >= self._limit[slots]]] = False  # the segment's last frame step
            self._inflight.append(_Step(self._step, slots, self._gen[slots]))
            first = bool((sched == 1).all())
        from_prefill = False
        if first and self.first_from_prefill and done:
            prefills, from_prefill = self._with_last_frames(prefills, slots, {r.slot: r for r in done})
        return Batch(admissions, prefills, slots, resumes, step=self._step, prefix_stores=stores, first_frames=first,
                     from_prefill=from_prefill)

    def _admissible(self, n: int) -> list[Request]:
        """Up to n requests to admit now, oldest first: the parked ones whose adapter became ready, then the queue's
        (each one's adapter pinned as it is taken); a queued request whose adapter is not ready is parked (its copy
        started when a pool slot can be had)."""
        out: list[Request] = []
        if n == 0:
            return out
        for a in list(self._parked):
            q = self._parked[a]
            if len(out) < n and self.adapters.want(a):
                while q and len(out) < n:
                    out.append(q.popleft())
                    self._n_parked -= 1
                    a.waiting -= 1
                    self.adapters.pin(a)  # now: not idle for the wants below
                if not q:
                    del self._parked[a]
        while self.waiting and len(out) < n:
            req = self.waiting.popleft()
            a = req.lora
            if a is None or self.adapters.want(a):
                out.append(req)
                if a is not None:
                    self.adapters.pin(a)
            else:
                req.parked_at = time.perf_counter()
                self._parked.setdefault(a, deque()).append(req)
                self._n_parked += 1
                a.waiting += 1
        return out

    def queued_ids(self) -> set[str]:
        """The requests not admitted yet (the queue's and the parked): none of them is in a step."""
        return {r.request_id for r in self.waiting} | {r.request_id for q in self._parked.values() for r in q}

    @property
    def num_parked(self) -> int:
        """Queued requests waiting for their adapter's pool slot."""
        return self._n_parked

    def overdue_parked(self, before: float) -> list[Request]:
        """The parked requests that began to wait before `before` (perf_counter) for an adapter that still has no
        pool slot, oldest of each adapter first, aborted here (their adapters' waits released): the engine ends them
        with AdapterPoolFullError. Those whose adapter has its slot (copying or ready) wait for an engine slot as
        any queued request does."""
        late = [r for a, q in self._parked.items() if a.slot < 0
                for r in itertools.takewhile(lambda r: r.parked_at < before, q)]
        for req in late:
            self.abort(req.request_id)
        return late

    def _with_last_frames(self, chunks: list[PrefillChunk], slots: np.ndarray, finals: dict[int, Request]
                          ) -> tuple[list[PrefillChunk], bool]:
        """EngineConfig.first_frame_from_prefill: when this step's prefill completes (finals: slot -> request) the
        prompt of every row of its frame step, each final chunk takes its prompt's last frame too (head): the first
        frame then runs from the hidden state the prefill keeps. Else the chunks as they are."""
        if (not set(slots.tolist()) <= finals.keys()
                or sum(len(c.tokens) for c in chunks) + len(finals) > self.prefill_token_budget):
            return chunks, False
        out = []
        for c in chunks:
            req = finals.get(c.slot)
            if req is not None and c.start + len(c.tokens) == req.seg_start_pos:  # the prompt's final chunk
                j = c.start - req.prompt_start
                c = PrefillChunk(c.slot, c.start, req.tokens[j:], req.mask[j:], head=True, adapter=c.adapter)
            out.append(c)
        return out, True

    def update(self, step: int, codes: np.ndarray) -> StepRows:
        """Take step `step`'s codes [len(decode_slots), K], rows in batch.decode_slots order."""
        rec = self._inflight_record(step)
        n = 0 if rec is None else len(rec.slots)
        if codes.shape[0] != n:
            raise ValueError(f"step {step}: {codes.shape[0]} rows of codes for {n} decode slots")
        if rec is None:
            return empty_rows(step, self.num_codebooks)
        self._inflight.popleft()
        rows = np.flatnonzero(self._gen[rec.slots] == rec.gen)  # [M]  # rows whose request and segment still run
        s = rec.slots[rows]
        codes = np.asarray(codes[rows], dtype=np.int64)  # indexing copies: the runner reuses its host buffer
        has = codes.any(axis=1)  # the all-zero frame ends the utterance (not counted, not emitted)
        start = self._num_frames[s]
        fs = self._seg_frames[s]
        f = s[has]
        if self.adapters is not None:  # frames per adapter (its metrics): a count per pool slot
            self.adapters.count_frames(self._lora_slot[f])
        self._seg_codes[f, fs[has]] = codes[has]
        self._num_frames[f] += 1
        self._seg_frames[f] += 1
        end = np.where(has, np.where(fs + 1 >= self._limit[s], END_LENGTH, END_NONE), END_EOS).astype(np.uint8)
        out = StepRows(step, rows, self._handle[s], codes, start, self._segment[s], has, end,
                       np.zeros(len(s), bool), self._owner[s])
        for i in np.flatnonzero(end):  # only rows that end their segment or request touch Python objects
            out.final[i] = self._end(out.requests[i], END_REASONS[end[i]])
        return out

    def frame_limit(self, req: Request) -> int:
        # the frame step for frame k of a segment runs at position seg_start_pos + k, inside max_seq_len;
        # the whole request's cap counts the frames of its earlier segments
        return min(req.params.segment_frames, req.params.max_frames - req.seg_first_frame,
                   self.max_seq_len - (req.prompt_start + req.prompt_len) + 1)

    # ---- helpers
    def _validate(self, req: Request) -> None:
        if req.status != RequestStatus.WAITING or req.request_id in self._requests:
            raise ValueError(f"request {req.request_id} was already added")
        w = self.num_codebooks + 1
        if req.tokens.ndim != 2 or req.tokens.shape[1] != w or req.mask.shape != req.tokens.shape:
            raise ValueError(f"prompt must be tokens/mask [P, {w}], got {req.tokens.shape} / {req.mask.shape}")
        if not 1 <= req.prompt_len <= self.max_seq_len:
            raise ValueError(f"prompt is {req.prompt_len} frames; it must be 1..{self.max_seq_len} (max_seq_len)")
        if not 0 <= req.context_len < req.prompt_len:
            raise ValueError(f"context_len {req.context_len} must be in [0, prompt_len)")
        if not 0 <= req.prefix_len < req.prompt_len:
            raise ValueError(f"prefix_len {req.prefix_len} must be in [0, prompt_len)")
        req.params.check()  # a value that cannot sample is this request's error, not the step's
        if req.adapter is not None:
            if self.adapters is None:
                raise ValueError(f"adapter {req.adapter!r}: this engine serves no LoRA adapters (max_loras = 0)")
            req.lora = self.adapters.get(req.adapter)  # UnknownAdapterError
        for tokens, mask in req.segments:
            self._check_segment(tokens, mask)

    def _check_segment(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        w = self.num_codebooks + 1
        if tokens.ndim != 2 or tokens.shape[1] != w or mask.shape != tokens.shape or len(tokens) < 1:
            raise ValueError(f"a segment must be tokens/mask [n, {w}], got {tokens.shape} / {mask.shape}")
        if len(tokens) + 3 > self.max_seq_len:  # + the tail (last frame, EOS) and one generated frame
            raise ValueError(f"a segment of {len(tokens)} frames does not fit in {self.max_seq_len} positions")

    def _admit(self, req: Request) -> Admission:
        slot = heapq.heappop(self._free)
        self.slots[slot] = self._owner[slot] = req
        self._handle[slot] = req.handle
        self._num_frames[slot] = 0
        self._segment[slot] = 0
        req.slot = slot
        req.admit_time = time.perf_counter()
        req.seg_start_pos = req.prompt_start + req.prompt_len - 1
        if req.open or req.segments:
            c = req.context_len
            ctx = (req.tokens[:c], req.mask[:c]) if c else None
            self._history[req.request_id] = _History(ctx, [_SegmentFrames(req.tokens[c:], req.mask[c:])])
        if req.lora is not None:  # pinned by _admissible
            self._lora_slot[slot] = req.lora.slot
        if req.params.seed is None:  # never share a noise stream with another unseeded request
            req.params = dataclasses.replace(req.params, seed=secrets.randbits(63))
        hit = self._lookup_prefix(req)
        return self._start_prompt(req, hit)

    def _start_prompt(self, req: Request, prefix_hit: bytes | None = None) -> Admission:
        """A slot's prompt is set (admission or next segment): prefill it, or step at once; the runner's
        load of the slot's first input frame, position and sampling params."""
        s = req.slot
        self._gen[s] += 1
        self._limit[s] = self.frame_limit(req)
        self._seg_scheduled[s] = self._seg_frames[s] = 0
        if req.num_to_prefill > 0:
            req.status = RequestStatus.PREFILLING
            self.prefilling.append(req)
        else:
            self._start_running(req)
        p = req.params
        return Admission(s, req.tokens[-1], req.mask[-1], req.seg_start_pos,
                         p.temperature, p.top_k, p.top_p, p.seed, prefix_hit=prefix_hit,
                         adapter=int(self._lora_slot[s]))

    def _lookup_prefix(self, req: Request) -> bytes | None:
        """The longest cached prefix (prefix_len, else a turn boundary): skip its prefill (the admission
        copies it). Unless all of prefix_len was cached: store it once prefilled."""
        n = req.prefix_len
        if self.prefix_cache is None or n < 1 or req.prompt_start != 0 or req.num_prefilled != 0:
            return None
        lengths = sorted({b for b in req.prefix_boundaries if 0 < b < n} | {n}, reverse=True)
        keys = prefix_keys(req.tokens, req.mask, lengths, 0 if req.lora is None else req.lora.id)
        hit = self.prefix_cache.longest([(keys[m], m) for m in lengths])
        if hit is None or hit[1] < n:  # store the whole prefix once prefilled
            self._pending_stores[req.request_id] = (keys[n], n)
        if hit is None:
            return None
        req.num_prefilled = hit[1]
        return hit[0]

    def _store_prefix(self, req: Request) -> None:
        pending = self._pending_stores.get(req.request_id)
        if pending is None or req.num_prefilled < pending[1]:
            return
        del self._pending_stores[req.request_id]
        key, n = pending
        if self.prefix_cache.reserve(key, n):
            self._stores.append(PrefixStore(req.slot, key, n, tuple(self.prefix_cache.take_evicted())))

    def _schedule_prefills(self) -> tuple[list[PrefillChunk], list[Request]]:
        """This step's chunks, and the requests whose prompts they complete (now running)."""
        chunks: list[PrefillChunk] = []
        budget, done = self.prefill_token_budget, []
        for req in self.prefilling:  # FIFO; a long prompt takes several steps
            if budget == 0:
                break
            n = min(req.num_to_prefill, budget, self.max_prefill_chunk)
            start = req.num_prefilled
            chunks.append(PrefillChunk(req.slot, req.prompt_start + start, req.tokens[start:start + n],
                                       req.mask[start:start + n], adapter=int(self._lora_slot[req.slot])))
            req.num_prefilled += n
            budget -= n
            if self._pending_stores:
                self._store_prefix(req)
            if req.num_to_prefill == 0:
                done.append(req)
        if done:
            self.prefilling = deque(r for r in self.prefilling if r.num_to_prefill > 0)
            for req in done:
                self._start_running(req)  # its first frame step runs in this same batch
        return chunks, done

    def _start_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        s = req.slot
        self._running[s] = True
        self._stepping[s] = self._limit[s] > 0

    def _stop_running(self, slot: int) -> None:
        self._running[slot] = self._stepping[slot] = False
        self._gen[slot] += 1  # rows still in flight for this slot are dropped

    def _inflight_record(self, step: int) -> _Step | None:
        while self._inflight and self._inflight[0].step < step:  # a step whose codes were never read
            rec = self._inflight[0]
            if (self._gen[rec.slots] == rec.gen).any():
                raise RuntimeError(f"update({step}) but step {rec.step}'s codes never came back")
            self._inflight.popleft()  # nobody waits for them (e.g. all aborted after a failed step)
        if not self._inflight or self._inflight[0].step > step:
            return None  # that step scheduled no frame
        return self._inflight[0]

    def _end(self, req: Request, reason: str) -> bool:
        """A row ended req's segment; -> True when that ends the request."""
        s = req.slot
        hist = self._history.get(req.request_id)
        budget_left = req.params.max_frames - int(self._num_frames[s])
        if hist is not None and (req.segments or req.open) and budget_left > 0:
            self._end_segment(req, hist, reason)
            return False
        self._finish(req, RequestStatus.FINISHED_EOS if reason == "eos" else RequestStatus.FINISHED_LENGTH)
        return True

    # ---- long-form
    def _eos_frame(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.num_codebooks
        mask = np.zeros((1, k + 1), dtype=bool)
        mask[:, :k] = True
        return np.zeros((1, k + 1), dtype=np.int64), mask

    def _audio(self, codes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Generated frames [n, K] as context frames followed by the EOS frame."""
        eos_t, eos_m = self._eos_frame()
        if codes is None or not len(codes):
            return eos_t, eos_m
        c = codes.astype(np.int64)
        tokens = np.concatenate([np.concatenate([c, np.zeros((len(c), 1), np.int64)], 1), eos_t])
        return tokens, np.repeat(eos_m, len(c) + 1, axis=0)

    def _end_segment(self, req: Request, hist: _History, reason: str) -> None:
        s = req.slot
        frames, scheduled = int(self._seg_frames[s]), int(self._seg_scheduled[s])
        hist.segments[-1].codes = self._seg_codes[s, :frames].copy()
        if reason == "eos":
            # the EOS frame is in KV iff a step after the one that produced it was scheduled
            in_kv = scheduled >= frames + 2
            hist.tail = None if in_kv else self._eos_frame()
            hist.next_pos = req.seg_start_pos + frames + 1 + int(in_kv)
        else:  # length: nothing consumed the last frame
            hist.tail = self._audio(hist.segments[-1].codes[-1:])
            hist.next_pos = req.seg_start_pos + frames
        hist.last_reason = reason
        req.segment += 1
        self._segment[s] = req.segment
        self._stop_running(s)
        if req.segments:
            self._start_next_segment(req, hist)
        else:
            req.status = RequestStatus.IDLE

    def _start_next_segment(self, req: Request, hist: _History) -> None:
        """Start the next segment in the request's slot: its prompt, then a resume."""
        text_t, text_m = req.segments.popleft()
        parts = ([hist.tail] if hist.tail is not None else []) + [(text_t, text_m)]
        size = sum(len(t) for t, _ in parts)
        start = hist.next_pos
        frames = min(req.params.segment_frames, req.params.max_frames - int(self._num_frames[req.slot]))
        need = len(text_t) - 1 + frames  # positions from the text's first frame to the last step
        if start + size - len(text_t) + need > self.max_seq_len:
            start, parts = 0, self._rebuild(hist, self.max_seq_len - need) + [(text_t, text_m)]
        hist.tail = None
        hist.segments.append(_SegmentFrames(text_t, text_m))
        req.tokens = np.concatenate([t for t, _ in parts])
        req.mask = np.concatenate([m for _, m in parts])
        req.prompt_start, req.num_prefilled = start, 0
        req.seg_start_pos = start + req.prompt_len - 1
        req.num_frames = req.seg_first_frame = int(self._num_frames[req.slot])
        # after an EOS the Mimi row decoded the all-zero EOS frame and the step in flight behind it, neither heard:
        # the next segment starts a fresh row (after its length, the audio runs on without a seam)
        self._resumes.append(dataclasses.replace(self._start_prompt(req), fresh_codec=hist.last_reason == "eos"))

    def _rebuild(self, hist: _History, room: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Context frames for a prefill from position 0 in at most `room` positions: the newest whole
        segments that fit (text + codes + EOS), after the request's own context if that still fits."""
        segs = [(t, self._audio(t.codes)) for t in hist.segments]
        sizes = [len(t.tokens) + len(a[0]) for t, a in segs]

        def newest_fitting(budget: int) -> int:  # how many of the newest segs fit in budget
            n, used = 0, 0
            for s in reversed(sizes):
                if used + s > budget:
                    break
                n, used = n + 1, used + s
            return n

        ctx_len = 0 if hist.context is None else len(hist.context[0])
        keep_ctx = hist.context is not None and ctx_len <= room  # the voice's clip and turns first, while they fit
        if not keep_ctx:
            hist.context = None
        n = newest_fitting(room - ctx_len if keep_ctx else room)
        kept = segs[len(segs) - n:] if n else []
        hist.segments = [t for t, _ in kept]
        out = [hist.context] if keep_ctx else []
        for t, a in kept:
            out += [(t.tokens, t.mask), a]
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.PREFILLING:
            self.prefilling.remove(req)
        self._history.pop(req.request_id, None)
        self._pending_stores.pop(req.request_id, None)
        if req.lora is not None:
            self.adapters.unref(req.lora, pinned=req.slot is not None)
        if req.slot is not None:
            s = req.slot
            req.num_frames = int(self._num_frames[s])
            self._resumes = [r for r in self._resumes if r.slot != s]
            self._stop_running(s)
            self._handle[s] = -1
            self._lora_slot[s] = -1
            self.slots[s] = self._owner[s] = None
            heapq.heappush(self._free, s)
            req.slot = None
        req.status = status
        del self._requests[req.request_id]
