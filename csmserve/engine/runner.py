"""GPU execution: admissions, batched prefill, and the frame step (graphed per bucket on CUDA).

The frame step reads each slot's next input frame from SlotState, runs one backbone position, the
codebook-0 sample and the 31-step depth loop, writes the generated frame back as the slot's next
input, and (with a codec) runs one batched Mimi streaming-decode step. No host sync inside.

Admissions and prefills take their inputs through pinned staging buffers (engine/staging.py): one
asynchronous copy per kind per step, no host sync, nothing allocated. A prefill is the backbone over
the packed tokens of every chunk of the step, each token a row with its own slot and position (the
frame step's attention kernel: each row reads its slot's keys up to its position), graphed by token
count (engine/prefill_graphs.py) up to `prefill_token_budget`.

LoRA (max_loras > 0): the model's LoRA pool (models/lora.py LoraPool) and each slot's pool slot (SlotState.adapter,
loaded with the admission); the frame step gathers its rows' pool slots, a prefill's rows carry theirs (a column of
the packed rows), and the LoRA'd projections read them (data in the graphs: whatever the adapters). Each bucket is
captured twice, with the LoRA kernels and without: a step (or prefill) none of whose rows has an adapter replays the
plain graph (host_adapter, the admissions' mirror of SlotState.adapter, says so without a sync). An adapter is
copied into its pool slot on a side stream that first waits for the work launched so far (the steps that may still
read the slot's last adapter); its event says when requests for it may be admitted.

A lone adapter is merged (lora_merge, models/lora.py LoraMerge): once MERGE_AFTER steps in a row had every row on
one adapter, it is added into the projections' own weights and those steps replay the plain graphs (the base's
speed: one fine-tuned voice on a GPU costs nothing); the first step or prefill with a row of the base or another
adapter copies the base weights back first (all on the launching stream, in order with the steps).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

from csmserve.models.csm import CSMModel
from csmserve.models.fp8 import quantize_weights
from csmserve.models.lora import LoraMerge, LoraPool, detach
from csmserve.models.mimi import Mimi, MimiStream
from csmserve.engine.buckets import bucket_sizes
from csmserve.engine.output_ring import OutputRing, StepOutput
from csmserve.engine.request import Admission, PrefillChunk, PrefixStore
from csmserve.models.sampler import sample
from csmserve.engine.slots import DepthKV, SlotKV, SlotState
from csmserve.engine.staging import Staging

if TYPE_CHECKING:
    from csmserve.engine.graphs import FrameGraphs

# the first frame from the prefill's hidden state (EngineConfig.first_frame_from_prefill) is graphed up to this many rows
FIRST_ROWS = 8
# admission staging columns: tokens [W], mask [W], then these
_POS, _TOPK, _SEED, _SLOT, _RESET, _ADAPTER = range(6)
_INTS = 6
# steps in a row with every row on one adapter before it is merged into the weights: a merge and its undo cost ~2
# launches per weight (~1 ms), so a batch whose adapters change every few steps stays on the LoRA kernels
MERGE_AFTER = 8


class StreamingCodec(Protocol):
    frame_size: int

    def decode_step(self, codes: Tensor, rows: Tensor) -> Tensor: ...  # [B, K, 1], [B] -> [B, frame_size]

    def reset(self, rows: Tensor) -> None: ...


def pack_prefill(chunks: list[PrefillChunk], T: int, width: int, scratch: int, lora: bool = False) -> np.ndarray:
    """The chunks' tokens packed as rows [T, 2W + 4] int64: tokens, mask, head (1: keep the row's hidden state
    as its slot's h0: a head chunk's last row), LoRA pool slot (-1: none), position, slot; padding rows write the
    scratch slot at position 0. lora (a runner with a pool): the chunks' pool slots, the chunks in order of them (the
    LoRA kernels' row tiles meet few); else every row -1 and the chunks as given."""
    a = np.zeros((T, 2 * width + 4), np.int64)
    a[:, -1] = scratch
    a[:, 2 * width + 1] = -1
    i = 0
    for c in sorted(chunks, key=lambda c: c.adapter) if lora and len(chunks) > 1 else chunks:
        n = len(c.tokens)
        a[i:i + n, :width] = c.tokens
        a[i:i + n, width:2 * width] = c.mask
        a[i:i + n, -2] = np.arange(c.start, c.start + n)
        a[i:i + n, -1] = c.slot
        if c.head:
            a[i + n - 1, 2 * width] = 1
        if lora:
            a[i:i + n, 2 * width + 1] = c.adapter
        i += n
    return a


class ModelRunner:
    def __init__(self, model: CSMModel, num_slots: int, max_seq_len: int, mimi: "Mimi | None" = None,
                 buckets: list[int] | None = None, use_graphs: bool | None = None, fuse: bool = True,
                 max_prefill_tokens: int = 512, output_ring: OutputRing | None = None,
                 max_prefill_chunk: int | None = None, weights: str = "bf16", codec_stream: bool = True,
                 max_loras: int = 0, max_lora_rank: int = 32, lora_merge: bool = True) -> None:
        quantize_weights(model, weights)  # EngineConfig.weights: fp8 swaps the GEMMs' weights in place
        # the LoRA adapters' pool (EngineConfig.max_loras), attached to the model's projections (FP8Linear's too)
        self.lora = LoraPool(model, max_loras, max_lora_rank) if max_loras else None
        if self.lora is None:
            detach(model)  # an earlier runner's pool on the same model: never read, never kept
        # a lone adapter merged into the weights (EngineConfig.lora_merge; not for FP8 weights)
        self.merge = LoraMerge(model, self.lora) if (self.lora is not None and lora_merge
                                                     and LoraMerge.possible(model, self.lora)) else None
        self._lone = (-1, 0)  # (pool slot, steps in a row with every row on it)
        self._lora_loads: list[tuple[object, int, object]] = []  # copies in flight: (event | None, slot, adapter)
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        cuda = self.device.type == "cuda"
        # one codec row per slot, plus the scratch row that padding points at
        self.codec: StreamingCodec | None = None if mimi is None else MimiStream(mimi, num_slots + 1, "decode", 1)
        self.cfg = model.cfg
        if cuda:
            model.prepare_heads()
            if fuse:  # fused norm / RoPE / SwiGLU kernels: about a third fewer kernels per frame
                from csmserve.models.llama import fuse_elementwise, fuse_gemv

                fuse_elementwise()
                fuse_gemv()  # GEMMs of 1-16 rows by kernels/gemv.py, with the norms, SiLU*up and gathers around them
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        # the frame step's prologue (gathers + embedding) and epilogue (next inputs) as one kernel each
        # (kernels/frame_io.py; the torch ops elsewhere)
        self.frame_io = cuda and fuse
        self.scratch = num_slots
        self.kv = SlotKV(self.cfg, num_slots, max_seq_len, self.dtype, self.device)
        # the prefix cache's tensors: key -> (k, v) [L, Hkv, n, hd]; the index is the scheduler's PrefixCache
        self.prefix_kv: dict[bytes, tuple[Tensor, Tensor]] = {}
        self.state = SlotState(self.cfg, num_slots, self.device)
        self.buckets = buckets or bucket_sizes(num_slots)
        self.depth_pos = torch.arange(self.cfg.num_codebooks, device=self.device)  # [K], never written
        self.depth_kv = DepthKV(self.cfg, self.buckets[-1], self.dtype, self.device, static_pos=self.depth_pos)
        self.audio_mask = torch.tensor([True] * self.cfg.num_codebooks + [False], device=self.device)
        self.host_pos = np.zeros(num_slots + 1, dtype=np.int64)  # mirror of state.pos (the torch path's kv bound; kept only without graphs)
        self.host_adapter = np.full(num_slots + 1, -1, dtype=np.int64)  # mirror of state.adapter: a step's LoRA or not
        self._step_adapters = np.empty(num_slots + 1, dtype=np.int64)  # a step's rows' host_adapter (no allocation)
        self.variants = (False,) if self.lora is None else (False, True)  # the graphs': without LoRA, with it
        W = self.cfg.frame_width
        self.max_prefill_tokens = max(max_prefill_tokens, max_prefill_chunk or 0)
        # tokens, mask, pos, top_k, seed, slot, reset, adapter
        self.admit_ints = Staging(num_slots + 1, 2 * W + _INTS, self.device)
        self.admit_floats = Staging(num_slots + 1, 2, self.device, torch.float32)  # temperature, top_p
        self.prefill_in = Staging(self.max_prefill_tokens, 2 * W + 4, self.device)  # pack_prefill rows
        # [N+1, D] each slot's prompt's last hidden state, kept by the prefill (PrefillChunk.head) for a first frame
        # step from_prefill (EngineConfig.first_frame_from_prefill); the scratch row takes every other row's
        self.h0 = torch.zeros(num_slots + 1, self.cfg.backbone.dim, dtype=self.dtype, device=self.device)
        fs = self.codec.frame_size if self.codec is not None else 0
        self.ring = output_ring or OutputRing(2, self.buckets[-1], self.cfg.num_codebooks, fs, cuda=cuda)
        self.graphs = self.prefill_graphs = None
        graphs = use_graphs if use_graphs is not None else cuda
        # Mimi's decode on a stream of its own beside the next frame's generation (EngineConfig.codec_stream;
        # engine/graphs.py): its rows are reset there too, from their own staging buffer. High priority (CUDA's -1):
        # a frame's decode waits for no queued block of the next generation
        self.codec_stream = (torch.cuda.Stream(priority=-1)
                             if graphs and codec_stream and self.codec is not None else None)
        self.codec_resets = Staging(num_slots + 1, 1, self.device) if self.codec_stream is not None else None
        self.lora_stream = torch.cuda.Stream() if cuda and self.lora is not None else None
        if graphs:
            from csmserve.engine.prefill_graphs import PrefillGraphs

            self.graphs = self.frame_graphs()
            self.prefill_graphs = PrefillGraphs(
                lambda packed, lora: self.prefill_forward(packed, self.max_seq_len, lora), self.prefill_in.dev,
                self.scratch, self.max_prefill_tokens, variants=self.variants)

    def frame_graphs(self) -> FrameGraphs:
        """The frame step, one CUDA graph per bucket (all captured here); and the first frame from the prefill's h0
        (no backbone pass) at the small buckets an idle engine's arrivals take (up to FIRST_ROWS; more rows run the
        plain step, which recomputes the last prompt position)."""
        from csmserve.engine.graphs import FrameGraphs

        apart = self.codec_stream is not None  # the decode in graphs of its own, on the codec stream
        return FrameGraphs(lambda ids, lora: self.frame_step(ids, self.max_seq_len, with_codec=not apart, lora=lora),
                           self.buckets, self.scratch, self.ring, self.device, codec=self.codec_step if apart else None,
                           codec_stream=self.codec_stream,
                           first=lambda ids, lora: self.frame_step(ids, self.max_seq_len, with_codec=not apart,
                                                                   from_prefill=True, lora=lora),
                           first_buckets=[b for b in self.buckets if b <= FIRST_ROWS], variants=self.variants)

    # ---- admissions and prefill ----
    def admit(self, admissions: list[Admission], prefixes: bool = True) -> None:
        """New requests: load each slot's first input, position and sampling params; reset its codec row;
        copy a cached prompt prefix's KV into the slot's first positions (device to device; prefixes=False:
        copy_prefixes did)."""
        self._load(admissions, reset=True)
        if prefixes:
            self.copy_prefixes(admissions)

    def copy_prefixes(self, admissions: list[Admission]) -> None:
        """The cached prompt prefixes' KV into the admitted slots: before the prefill that attends to them."""
        for a in admissions:
            if a.prefix_hit is not None:
                k, v = self.prefix_kv[a.prefix_hit]
                n = k.shape[2]
                self.kv.k[:, a.slot, :, :n].copy_(k)
                self.kv.v[:, a.slot, :, :n].copy_(v)

    def store_prefixes(self, stores: list[PrefixStore]) -> None:
        """After the prefill: drop evicted entries, keep copies of slots' KV[:, :n] (no host sync)."""
        for st in stores:
            for key in st.evict:
                self.prefix_kv.pop(key, None)
            self.prefix_kv[st.key] = (self.kv.k[:, st.slot, :, :st.n].clone(),
                                      self.kv.v[:, st.slot, :, :st.n].clone())

    @property
    def prefix_kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.prefix_kv.values())

    def resume(self, resumes: list[Admission]) -> None:
        """Long-form continuations: the same loads, but the codec row (the audio runs on without a seam) and the
        frame counter (the sampling noise stream) carry over; a fresh_codec one's codec row starts anew."""
        fresh = [a for a in resumes if a.fresh_codec]
        self._load(fresh + [a for a in resumes if not a.fresh_codec], reset=False, codec_rows=len(fresh))

    def _load(self, admissions: list[Admission], reset: bool, codec_rows: int | None = None) -> None:
        """reset: the rows' frame counters and codec rows start anew; codec_rows: only the first this many rows'
        codec rows (one staged load either way: no second copy in the step)."""
        if not admissions:
            return
        W, n = self.cfg.frame_width, len(admissions)
        ints = np.empty((n, 2 * W + _INTS), np.int64)
        floats = np.empty((n, 2), np.float32)
        for i, a in enumerate(admissions):  # rows that start: the only per-row Python here
            ints[i, :W], ints[i, W:2 * W] = a.first_tokens, a.first_mask
            ints[i, 2 * W:] = (a.first_pos, a.top_k, a.seed, a.slot, int(reset), a.adapter)
            floats[i] = (a.temperature, a.top_p)
            self.host_pos[a.slot] = a.first_pos
            self.host_adapter[a.slot] = a.adapter
        d, f = self.admit_ints.put(ints), self.admit_floats.put(floats)
        s, c = self.state, 2 * W
        slots = d[:, c + _SLOT]
        s.next_tokens.index_copy_(0, slots, d[:, :W])
        s.next_mask.index_copy_(0, slots, d[:, W:c].bool())
        s.pos.index_copy_(0, slots, d[:, c + _POS])
        s.top_k.index_copy_(0, slots, d[:, c + _TOPK])
        s.seed.index_copy_(0, slots, d[:, c + _SEED])
        s.temperature.index_copy_(0, slots, f[:, 0])
        s.top_p.index_copy_(0, slots, f[:, 1])
        if self.lora is not None:
            s.adapter.index_copy_(0, slots, d[:, c + _ADAPTER])
        if reset:
            s.frame.index_fill_(0, slots, 0)
        k = n if codec_rows is None else codec_rows
        if k:
            if self.codec_stream is not None:  # after the decode of the slot's last stream, before its next
                with torch.cuda.stream(self.codec_stream):
                    self.codec.reset(self.codec_resets.put(ints[:k, c + _SLOT:c + _SLOT + 1])[:, 0])
            elif self.codec is not None:
                self.codec.reset(slots[:k])

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> None:
        """Every chunk of the step in one backbone pass over their packed tokens (KV written in the slots)."""
        if not chunks:
            return
        n = sum(len(c.tokens) for c in chunks)
        if n > self.max_prefill_tokens:
            raise ValueError(f"{n} prefill tokens in one step > max_prefill_tokens={self.max_prefill_tokens}")
        T = n if self.prefill_graphs is None else self.prefill_graphs.bucket(n)
        lora = self.lora is not None and self._lora_variant(min(c.adapter for c in chunks),
                                                            max(c.adapter for c in chunks), False)
        packed = self.prefill_in.put(pack_prefill(chunks, T, self.cfg.frame_width, self.scratch, lora))
        if self.prefill_graphs is not None:
            self.prefill_graphs.run(packed, lora)
            return
        bound = max(c.start + len(c.tokens) for c in chunks)
        self.prefill_forward(packed, bound, lora)

    def prefill_forward(self, packed: Tensor, kv_bound: int, lora: bool = True) -> None:
        """packed [T, 2W + 4] (pack_prefill) -> KV of each token written at its slot and position. lora=False: no
        chunk has an adapter (the projections run without the pool's kernels)."""
        W = self.cfg.frame_width
        tokens, mask = packed[:, None, :W], packed[:, None, W:2 * W].bool()  # [T, 1, W]
        # the kernels (RoPE, K/V store, attention) index positions and slots as contiguous arrays
        pos, slot_tok = packed[:, -2:-1].contiguous(), packed[:, -1].contiguous()  # [T, 1], [T]
        self.kv.set_decode(slot_tok, kv_bound)
        with self._lora_rows(packed[:, 2 * W + 1] if self.lora is not None and lora else None):  # rows' pool slots
            h = self.model.forward_backbone(tokens, mask, pos, self.kv)  # [T, 1, D]
        # the head rows' hidden states -> their slots' h0 (every other row -> the scratch row)
        self.h0.index_copy_(0, torch.where(packed[:, 2 * W] != 0, slot_tok, self.scratch), h[:, 0])

    # ---- the frame step ----
    def frame_step(self, slot_ids: Tensor, kv_bound: int, with_codec: bool = True,
                   from_prefill: bool = False, lora: bool = True) -> tuple[Tensor, Tensor | None]:
        """slot_ids [B] (padding = scratch slot) -> codes [B, K], pcm [B, frame_size] | None (with_codec=False:
        None; the decode is then `codec_step`'s, on the codec stream). from_prefill: each row's first frame, from
        the hidden state the prefill kept (h0; its last prompt position's KV is written): no backbone pass.
        lora=False: no row has an adapter, the projections run without the pool's kernels."""
        s, m = self.state, self.model
        if self.frame_io:  # kernels/frame_io.py: the gathers and the embedding in one kernel
            from csmserve.kernels.frame_io import prologue_triton

            fi = prologue_triton(s, slot_ids, m.audio_embeddings.weight, m.text_embeddings.weight,
                                 self.cfg.num_codebooks, self.cfg.audio_vocab_size, embed=not from_prefill)
            x, pos, lengths = fi.x, fi.pos, fi.lengths
            temp, top_k, top_p, seed, frame = fi.temperature, fi.top_k, fi.top_p, fi.seed, fi.frame
        else:
            pos, lengths = s.pos[slot_ids], None  # [B]
            x = None if from_prefill else m.embed_frames(s.next_tokens[slot_ids][:, None], s.next_mask[slot_ids][:, None])
            temp, top_k, top_p = s.temperature[slot_ids], s.top_k[slot_ids], s.top_p[slot_ids]
            seed, frame = s.seed[slot_ids], s.frame[slot_ids]
        n = self.cfg.sampleable_codes

        def sampler(logits: Tensor, codebook: int) -> Tensor:
            return sample(logits[:, :n], temp, top_k, top_p, seed, frame, codebook)

        with self._lora_rows(s.adapter[slot_ids] if self.lora is not None and lora else None):  # [B] pool slots
            if from_prefill:
                h = self.h0[slot_ids]  # [B, D]
            else:
                self.kv.set_decode(slot_ids, kv_bound, lengths)
                h = m.backbone(x, pos[:, None], self.kv)[:, 0]  # [B, D]
            codes = m.decode_frame(h, sampler, self.depth_kv, self.depth_pos)  # [B, K]
        if self.frame_io:
            from csmserve.kernels.frame_io import epilogue_triton

            epilogue_triton(s, slot_ids, codes, pos, frame, self.scratch, self.max_seq_len - 1)
        else:
            live = slot_ids != self.scratch
            s.next_tokens[slot_ids] = torch.cat([codes, torch.zeros_like(codes[:, :1])], 1)
            s.next_mask[slot_ids] = self.audio_mask.expand(len(slot_ids), -1)
            s.pos[slot_ids] = torch.where(live, (pos + 1).clamp(max=self.max_seq_len - 1), 0)
            s.frame[slot_ids] = torch.where(live, frame + 1, 0)
        # float32 here, inside the graph: the host ring's dtype, no cast allocated per step outside it
        pcm = None if self.codec is None or not with_codec else self.codec_step(codes, slot_ids)
        return codes, pcm

    @contextmanager
    def _lora_rows(self, rows: Tensor | None) -> Iterator[None]:
        """The LoRA'd projections read these rows' pool slots [B] (-1: none) inside; outside, no LoRA at all."""
        if self.lora is None or rows is None:
            yield
            return
        self.lora.rows = rows.contiguous()
        try:
            yield
        finally:
            self.lora.rows = None

    def _lora_variant(self, lo: int, hi: int, step: bool) -> bool:
        """Rows whose pool slots span [lo, hi] (-1: the base) run next: True for the LoRA kernels, False for the plain
        ones. With a merge: the merged adapter's rows alone run plain; a frame step whose rows share one adapter
        counts towards its merge (MERGE_AFTER); any other rows get the base weights back first."""
        m = self.merge
        if m is None:
            return hi >= 0
        if lo == hi >= 0:
            if m.slot == lo:
                return False
            if step:
                n = self._lone[1] + 1 if self._lone[0] == lo else 1
                self._lone = (lo, n)
                if n >= MERGE_AFTER:
                    m.merge(lo)
                    return False
        elif step:
            self._lone = (-1, 0)
        m.restore()
        return hi >= 0

    # ---- LoRA adapters' copies ----
    def load_loras(self, loads: list[tuple[int, object]]) -> None:
        """(pool slot, engine/adapters.py Adapter) copies, started now: on the side stream after every step launched
        so far (they may read the slot's last adapter), before any step that reads the new one (its requests are
        admitted once `lora_loads_done` says so)."""
        for slot, a in loads:
            if self.merge is not None and self.merge.slot == slot:  # the slot's last adapter leaves the weights too
                self.merge.restore()
            if self.lora_stream is None:  # CPU: at once
                self.lora.write(slot, a.weights)
                self._lora_loads.append((None, slot, a))
                continue
            self.lora_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.lora_stream):
                self.lora.write(slot, a.weights)
                ev = torch.cuda.Event()
                ev.record()
            self._lora_loads.append((ev, slot, a))

    def lora_loads_done(self) -> list[tuple[int, object]]:
        """The copies finished since the last call (a query of their events: no host sync)."""
        if not self._lora_loads:
            return []
        finished = [ev is None or ev.query() for ev, _, _ in self._lora_loads]
        done = [(slot, a) for (_, slot, a), f in zip(self._lora_loads, finished) if f]
        self._lora_loads = [x for x, f in zip(self._lora_loads, finished) if not f]
        return done

    def codec_step(self, codes: Tensor, slot_ids: Tensor) -> Tensor:
        """codes [B, K] of one frame -> pcm [B, frame_size] float32 (the host ring's dtype, cast inside the graph)."""
        return self.codec.decode_step(codes[:, :, None], slot_ids).float()

    @torch.inference_mode()
    def step(self, slots: np.ndarray, step_id: int = -1, from_prefill: bool = False) -> StepOutput | None:
        """One frame for each of `slots` [B] (sorted, unique): launched; results in the next ring buffer,
        whose header then names `step_id`. from_prefill (Batch.from_prefill): every row's first frame, from the
        hidden state this step's prefill kept (frame_step's from_prefill; more than FIRST_ROWS rows: the plain step)."""
        if not len(slots):
            return None
        slots = np.asarray(slots, np.int64)
        ring = self.ring.next()
        self.ring.header[ring] = step_id  # before the launch: a reader of an older step sees the reuse
        # some row has an adapter (not merged): the LoRA variant (the rows' host_adapter gathered into a buffer)
        lora = False
        if self.lora is not None:
            ad = np.take(self.host_adapter, slots, out=self._step_adapters[:len(slots)], mode="clip")
            lora = self._lora_variant(int(ad.min()), int(ad.max()), True)
        if self.graphs is not None:  # the graphs attend up to max_seq_len: no host-side bound to keep
            return self.graphs.run(slots, ring, first=from_prefill, lora=lora)
        self.host_pos[slots] += 1
        bound = int(self.host_pos[slots].max())  # the torch path attends to [0, bound)
        codes, pcm = self.frame_step(torch.from_numpy(slots).to(self.device), bound, from_prefill=from_prefill,
                                     lora=lora)
        n, r = len(slots), self.ring
        r.codes[ring, :n].copy_(codes)
        if pcm is not None:
            r.pcm[ring, :n].copy_(pcm)
        return StepOutput(slots, r.codes[ring], None if pcm is None else r.pcm[ring], None, ring)
