"""The records that policy (scheduler) and execution (runner) share."""
from __future__ import annotations

import enum
import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from csmserve.sampling import SamplingParams

# how a row's request or segment ended with a step (StepRows.end, EngineStep.end): the codes and their reasons
END_NONE, END_EOS, END_LENGTH = 0, 1, 2
END_REASONS = (None, "eos", "length")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    IDLE = "idle"  # long-form: a segment ended, the next one's text has not arrived; holds its slot, not stepped
    FINISHED_EOS = "finished_eos"  # the all-zero frame
    FINISHED_LENGTH = "finished_length"  # max_audio_length_ms reached
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """AudioChunk.finish_reason for a finished status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_EOS: "eos", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


_ids = itertools.count()
_handles = itertools.count()
_RUN = secrets.token_hex(4)  # request ids stay unique across the server's processes


@dataclass(eq=False)
class Request:
    tokens: np.ndarray  # [P, 33] int64 prompt frames
    mask: np.ndarray  # [P, 33] bool
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{_RUN}-{next(_ids)}")
    # the number that names this request in the engine's vectorised outputs (StepRows.handles); an
    # EngineClient in another process sets its own (client id in the high bits)
    handle: int = field(default_factory=lambda: next(_handles))
    # long-form: more target turns generated after this one in the same slot, each seeing the earlier
    # ones (their text and generated audio) through the slot's KV; one continuous audio stream
    segments: deque = field(default_factory=deque)  # pending next turns: (tokens, mask) [n, 33] text frames
    open: bool = False  # more segments may still be appended (text streamed in); the slot idles meanwhile
    context_len: int = 0  # prompt frames before the first target turn's text (kept first on a re-prefill)
    # prompt-prefix cache: the leading positions that form a reusable prefix (a voice's reference turn,
    # a conversation's earlier turns; CSM.request sets it to the context's length). < prompt_len; 0 = none
    prefix_len: int = 0
    # shorter cacheable prefixes (the context's turn boundaries, each in [1, prefix_len)): on a miss of
    # prefix_len the longest cached one is used and the rest of the prefix prefilled
    prefix_boundaries: tuple[int, ...] = ()
    adapter: str | None = None  # the LoRA adapter it speaks with (a name the engine serves); None: the base model
    # engine-owned state
    lora: object | None = None  # the registered adapter (engine/adapters.py Adapter) `adapter` names
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_prefilled: int = 0  # prompt positions whose KV is written (prefill stops at P-1)
    num_frames: int = 0  # frames generated so far (EOS frame excluded)
    arrival_time: float = 0.0
    admit_time: float | None = None  # perf_counter when it got a slot (queue time = admit - arrival)
    parked_at: float = 0.0  # perf_counter when it began to wait for its adapter's pool slot (max_lora_wait_s)
    prompt_start: int = 0  # slot position of tokens[0] (> 0 for a long-form continuation)
    segment: int = 0  # index of the target turn being generated
    seg_start_pos: int = 0  # position of the segment's first frame step (its prompt's last frame)
    seg_first_frame: int = 0  # index of the segment's first frame within the request's frames

    @property
    def prompt_len(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_to_prefill(self) -> int:
        # every prompt position but the last; the last enters through the first frame step
        return self.prompt_len - 1 - self.num_prefilled


@dataclass
class AudioChunk:
    request_id: str
    audio: np.ndarray  # [n * 1920] float32 at 24 kHz (empty when the codec is not loaded)
    codes: np.ndarray  # [n, 32] int64
    frame_start: int  # index of codes[0] within the request's generated frames
    final: bool = False
    finish_reason: str | None = None  # "eos" | "length" | "abort" | "error" on the final chunk
    segment: int = 0  # long-form: index of the target turn (sentence / clause) these frames speak
    text: str | None = None  # that turn's text, where the caller knows it (CSM.speak sets it)
    # long-form: "eos" | "length" on the chunk that ends its segment (the last segment: see final);
    # it may carry no codes (the segment's last frames went in an earlier chunk)
    segment_end: str | None = None


@dataclass(frozen=True)
class PrefillChunk:
    slot: int
    start: int  # position of tokens[0] in the slot's context
    tokens: np.ndarray  # [n, 33]
    mask: np.ndarray  # [n, 33]
    head: bool = False  # tokens[-1] is the prompt's last frame: its hidden state is kept (runner.h0) for the first frame
    adapter: int = -1  # the LoRA pool slot of its request's adapter; -1: none


@dataclass(frozen=True)
class Admission:
    """A slot starting a new request: reset its per-row state, load its sampling params and its first input."""

    slot: int
    first_tokens: np.ndarray  # [33] the prompt's last frame, input to the first frame step
    first_mask: np.ndarray  # [33]
    first_pos: int  # = prompt_len - 1
    temperature: float
    top_k: int
    top_p: float
    seed: int
    prefix_hit: bytes | None = None  # prefix-cache key whose KV is copied into the slot's first positions
    adapter: int = -1  # the LoRA pool slot its rows read; -1: none
    fresh_codec: bool = False  # a resume whose Mimi row starts anew (its segment before ended on EOS)


@dataclass(frozen=True)
class PrefixStore:
    """After this step's prefill: drop the evicted entries, then keep a copy of slot's KV[:, :n] under key."""

    slot: int
    key: bytes
    n: int
    evict: tuple[bytes, ...] = ()  # entries the index dropped to make room (before this store)


@dataclass(frozen=True)
class Batch:
    """One engine step: admissions, resumes and prefill chunks run first, then one frame per decode slot.

    A resume is an Admission for a slot that continues its request with the next segment: it loads the
    next input frame, position and sampling params but keeps the codec row and the frame counter."""

    admissions: list[Admission] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # [B] sorted (with LoRA adapters: by adapter pool slot, then slot: a kernel's row tile meets few adapters)
    decode_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    resumes: list[Admission] = field(default_factory=list)
    step: int = 0  # scheduler step id; hand it back with this step's codes to Scheduler.update
    prefix_stores: list[PrefixStore] = field(default_factory=list)  # run after the prefills, in order
    first_frames: bool = False  # every decode slot makes its request's (or segment's) first frame
    from_prefill: bool = False  # ... from the hidden state this step's prefill keeps (PrefillChunk.head)

    @property
    def empty(self) -> bool:
        return not (self.admissions or self.prefills or len(self.decode_slots) or self.resumes)
