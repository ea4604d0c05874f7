"""A paced stand-in engine: the real Engine (scheduler, output ring, routing) over a runner with no model,
whose frame step takes the GPU's measured time for its row count (`--model paced`).

It makes the data path measurable without a GPU: `csmserve serve --model paced` (and `--ray`, through the same
flags) runs the server's every process as it runs with a model, and the load benchmark drives it
(bench/serve_bench.py --setup). Each step writes random codes that never end early (a request runs to its
max_audio_length_ms) into the shared-memory output ring; the ring's PCM is noise written once (the GPU's
device-to-host copy costs the host nothing, nor does this). Time is simulated as one GPU stream: a prefill
and a frame step start when both the host has launched them and the step before has finished; a step's results
are ready (`done`, `wait`) after its measured duration.

Where the numbers come from (docs/benchmarks.md; ms per frame step with Mimi's decode, bf16, graphs):
  1 / 2 / 4 / 16 / 64 rows: 4.63 / 4.80 / 6.88 / 7.21 / 8.27 (H200, commit `665e654`, "Where the frame step
    stands now", the 3-16-row kernel split over K);
  256 / 512 / 1,024 rows: 13.22 / 19.07 / 33.96 (H100, `675b39a`, "FP8 weights no slower than bf16", the bf16
    column: the H200 has no newer sweep at these sizes; at 2,048 rows the H100 took 63.5 ms, ~5-10% above
    the H200);
  2,048 rows: 57.53 (H200, `5566037`, "Where the frame step stands now").
A batch runs at its graph bucket (engine/buckets.py: powers of two to 256, then every 256), interpolated
linearly between the table's sizes. Prefill (a packed pass over the step's prompt positions): 12 / 166 /
1,000 positions 1.47 / 2.14 / 8.69 ms (H200, `322c093`, "Through the real server, as users see it"),
linear beyond.

This file is the only one that knows it: engine.py, the scheduler and the router run unchanged, and
`CSM("paced")` (api.py) builds this engine instead of a model's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from csmserve.config import FRAME_SAMPLES, EngineConfig
from csmserve.engine.output_ring import OutputRing

PACED_MODEL = "paced"  # the --model name
BUCKET_STEP = 256  # engine/buckets.py's bucket_sizes step
NUM_CODEBOOKS = 32
CODES = 2048  # codes Mimi decodes (the vocab's 2048..2050 are never sampled)
# rows -> ms per frame step with Mimi (the module docstring says where each was measured)
STEP_MS = ((1, 4.63), (2, 4.80), (4, 6.88), (16, 7.21), (64, 8.27), (256, 13.22), (512, 19.07), (1024, 33.96),
           (2048, 57.53))
PREFILL_MS = ((0, 0.0), (12, 1.47), (166, 2.14), (1000, 8.69))  # prompt positions -> ms
# with no --max-slots: what one H200 holds at --max-seq-len 512 (docs/benchmarks.md: 2,056 slots, 49 GiB)
DEFAULT_SLOTS = 2048
# with no --prefix-cache-bytes: the index of a cache the size a GPU would give it (no KV is kept here)
DEFAULT_PREFIX_CACHE_BYTES = 8 << 30
KV_BYTES_PER_POSITION = 32 << 10  # CSM-1B's backbone KV in bf16: 16 layers x K and V x 8 heads x 64 x 2 bytes


def _interp(table: tuple[tuple[int, float], ...], x: float) -> float:
    """Linear between the table's points, linear past its last two."""
    xs, ys = [p[0] for p in table], [p[1] for p in table]
    if x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    return ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])


def frame_step_s(rows: int, max_rows: int = 1 << 30) -> float:
    """Seconds of one frame step of `rows` rows: its graph bucket's time."""
    if rows <= 0:
        return 0.0
    return _interp(STEP_MS, _bucket(rows, max_rows)) / 1e3


def _bucket(rows: int, max_rows: int) -> int:
    """The graph bucket a batch of `rows` runs at: engine/buckets.py's bucket_sizes(max_rows), computed."""
    if rows >= max_rows:
        return rows
    b = 1
    while b < rows and b < BUCKET_STEP:
        b *= 2
    return min(b if b >= rows else -(-rows // BUCKET_STEP) * BUCKET_STEP, max_rows)


def prefill_s(positions: int) -> float:
    """Seconds of a packed prefill over `positions` prompt positions."""
    return _interp(PREFILL_MS, positions) / 1e3 if positions > 0 else 0.0


@dataclass
class PacedOutput:
    """One paced step's results in the output ring: ready at `ready_at` (time.perf_counter)."""

    slots: np.ndarray  # [B]
    codes: np.ndarray  # [B, K] int64, ring buffer `ring`
    pcm: np.ndarray  # [B, frame_size] float32
    ring: int
    ready_at: float

    def done(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self.codes, self.pcm

    def codec_lag_s(self) -> float:
        return 0.0


class PacedRunner:
    """ModelRunner's surface (engine.py's use of it), no model: steps take the measured time."""

    @dataclass(frozen=True)
    class _Cfg:
        num_codebooks: int = NUM_CODEBOOKS

    @dataclass(frozen=True)
    class _KV:
        bytes_per_position: int = KV_BYTES_PER_POSITION

    def __init__(self, max_slots: int, ring_slots: int = 2, ring_path: str | None = None, seed: int = 0) -> None:
        self.device, self.cfg, self.kv = torch.device("cpu"), self._Cfg(), self._KV()
        self.max_slots = max_slots
        self.ring = OutputRing(ring_slots, max_slots, NUM_CODEBOOKS, FRAME_SAMPLES, path=ring_path)
        rng = np.random.default_rng(seed)
        self._codes = self.ring.codes.numpy()  # [R, B, K] views of the ring (shared memory with a path)
        self._pcm = self.ring.pcm.numpy()  # [R, B, frame_size]
        noise = (rng.standard_normal((max_slots, FRAME_SAMPLES)) * 0.1).astype(np.float32)  # [B, frame_size]
        for r in range(ring_slots):
            self._pcm[r] = noise
        self._table = rng.integers(1, CODES, (4099, NUM_CODEBOOKS), dtype=np.int64)  # [T, K] never all-zero
        self._free_at = 0.0  # when the simulated GPU has finished what it was given
        self.steps = 0

    def _run(self, seconds: float) -> float:
        """Queue `seconds` of GPU work behind what is queued -> when it ends."""
        self._free_at = max(time.perf_counter(), self._free_at) + seconds
        return self._free_at

    def admit(self, admissions, prefixes: bool = True) -> None:
        pass

    resume = store_prefixes = copy_prefixes = admit

    def prefill(self, chunks) -> None:
        if chunks:
            self._run(prefill_s(sum(len(c.tokens) for c in chunks)))

    def step(self, slots: np.ndarray, step_id: int = -1, from_prefill: bool = False) -> PacedOutput | None:
        if not len(slots):
            return None
        n = len(slots)
        ring = self.ring.next()
        self.ring.header[ring] = step_id  # before the results: a reader of an older step sees the reuse
        self._codes[ring, :n] = self._table[(np.asarray(slots) * 7 + step_id) % len(self._table)]
        self.steps += 1
        return PacedOutput(np.asarray(slots), self._codes[ring, :n], self._pcm[ring, :n], ring,
                           self._run(frame_step_s(n, self.max_slots)))


def stand_in_codes(audio: np.ndarray) -> np.ndarray:
    """A clip's "Mimi codes" without Mimi: [ceil(samples / 1920), 32] in [0, 2048), the same for the same clip."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1 or audio.size == 0:
        raise ValueError(f"audio must be a non-empty 1-D waveform at 24 kHz, got shape {audio.shape}")
    frames = -(-audio.size // FRAME_SAMPLES)
    seed = int.from_bytes(hashlib.blake2b(audio.tobytes(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    return rng.integers(0, CODES, (frames, NUM_CODEBOOKS), dtype=np.int64)


def build_paced_engine(config: EngineConfig, start: bool = True, emit=None, inbox=None, ring_path: str | None = None,
                       ring_slots: int = 2):
    """engine.build_engine's counterpart: an Engine over a PacedRunner (max_slots None: DEFAULT_SLOTS; prefix
    cache None: DEFAULT_PREFIX_CACHE_BYTES of index)."""
    from csmserve.engine.engine import Engine  # not at import: api.py imports PACED_MODEL from here

    cfg = dataclasses.replace(
        config, max_slots=config.max_slots or DEFAULT_SLOTS,
        prefix_cache_bytes=DEFAULT_PREFIX_CACHE_BYTES if config.prefix_cache_bytes is None else config.prefix_cache_bytes)
    return Engine(PacedRunner(cfg.max_slots, ring_slots, ring_path), cfg, start=start, emit=emit, inbox=inbox)
