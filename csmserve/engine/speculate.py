"""Draft/verify over codebooks inside one frame's depth decoder (EngineConfig.spec_depth = k), exact.

The depth decoder's position i reads codebook i-1's code and its head i gives codebook i. Every
head reads the same residual stream, so once position m has produced codebook m (hidden state h_m),
the heads of codebooks m+1..m+k applied to h_m give *drafts* of the next k codes, one GEMV each:

    q_c = the request's sampling distribution (temperature, top-k, top-p, cut exactly as `sample`
          cuts) of head_c(h_m), c = m+1..m+k: head c read c-m positions early, on the hidden state
          of the position that produced codebook m instead of position c (the one that reads code c-1).
    draft d_c ~ q_c (greedy rows: argmax of head_c(h_m)).

One verify pass of the depth decoder over the committed code c_m and the k drafts (positions
m+1..m+k+1) gives the real distributions p_{m+1..m+k+1}. Drafts are accepted in order while
u_c * q_c(d_c) < p_c(d_c) (probability min(1, p/q); greedy: while d_c is p_c's argmax); the first
rejected codebook is resampled from the normalised residual max(0, p_c - q_c) (greedy: p_c's argmax);
if all k are accepted, codebook m+k+1 is sampled from p_{m+k+1} (a bonus code). Each pass commits
1..k+1 codes and the codes' distribution is the plain sampler's (Leviathan et al. 2023, Chen et al. 2023).

Noise is counter-based as in `sample`: (seed, frame, codebook, token) hashed, with a draw index per
use (engine/sampler.hash_uniform_at): 0 for codebooks 0 and 1 (the plain sampler, same codes) and
bonus codes, 1 for drafts, 2 for accept tests, 3 for residual resamples. A codebook's noise of each
draw decides at most once (drafts past a rejection are redrawn from a later hidden state with the
same noise, which had decided nothing), so a seeded request is reproducible and independent of its
batch.

Rows progress raggedly: each row keeps its own m (the last committed codebook), the verify pass is
the same [B, k+1] pass for all rows at per-row positions m+1..m+k+1, and finished rows do masked
no-op work (their positions fall in the KV's spare positions K..K+k). At most K-2 passes; in a CUDA
graph of up to 128 rows each pass after the first is an IF node on "some row unfinished" (CUDA 12.4
conditional nodes), so the graph runs as many passes as the slowest row needs; larger graphs run all
K-2; eagerly the loop stops when all rows are done. The same passes either way: the same codes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from csmserve.models.csm import CSMModel
from csmserve.models.llama import KVView
from csmserve.models.sampler import GREEDY_BELOW, hash_uniform_at, sampling_logits
from csmserve.engine.slots import DepthKV

DRAW_PLAIN, DRAW_DRAFT, DRAW_ACCEPT, DRAW_RESIDUAL = 0, 1, 2, 3
SPEC_DEPTHS = range(2, 9)  # EngineConfig.spec_depth


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters of a frame step, all [B]."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    seed: Tensor
    frame: Tensor

    def repeat(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        # temperature/top_k/top_p for [B * n] rows (row-major: b's n entries together)
        return tuple(t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p))

    def fields(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self.temperature, self.top_k, self.top_p, self.seed, self.frame


def conditional_nodes_supported() -> bool:
    return hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph") and hasattr(
        torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def gumbel(u: Tensor) -> Tensor:
    return -torch.log(-torch.log(u))


class _WriteAt(KVView):
    """KVView over a DepthKV whose keys/values go to `write` positions while RoPE reads the model's
    positions (clamped into its K-row tables: only finished rows and past-the-end drafts, whose outputs
    are never used, read a clamped position). On CUDA each of the S positions of a row is one query of
    the decode-attention kernel (keys up to its own position): the plain depth step's two kernels per
    layer instead of a masked SDPA."""

    def __init__(self, kv: DepthKV) -> None:
        self.kv, self.write = kv, None
        self.use_triton = kv.use_triton
        self.rows = self.pos = self.lengths = None
        self.prepared = False
        self.row_of: dict[int, Tensor] = {}

    def prepare(self, pos: Tensor, lengths: Tensor) -> None:
        """The next forward's KV positions [B S] and attention lengths [B S] int32, already computed."""
        self.pos, self.lengths, self.prepared = pos, lengths, True

    def begin(self, pos: Tensor) -> None:
        w = pos if self.write is None else self.write  # [B, S]
        if self.prepared:  # the prepared KV positions, not the (clamped) RoPE positions `pos`
            B, S = pos.shape
            if self.use_triton:
                self.rows = self._rows(B, S)
            else:  # torch attention (head_dim < 16): it too must write the unclamped positions
                self.kv.begin(self.pos.view(B, S))
            return
        if not self.use_triton:
            self.kv.begin(w)
            return
        B, S = w.shape
        self.rows = self._rows(B, S)
        self.pos = w.flatten()
        self.lengths = (self.pos + 1).to(torch.int32)

    def _rows(self, B: int, S: int) -> Tensor:
        if S not in self.row_of:  # [max B * S] each query's row, made once per S (in the graphs' warm-up)
            self.row_of[S] = self.kv.rows.repeat_interleave(S)
        return self.row_of[S][: B * S]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.use_triton:
            return self.kv.attend(layer, q, k, v)
        from csmserve.kernels.decode_attention import decode_attention_triton
        from csmserve.engine.slots import store_kv_triton

        B, S, Hq, hd = q.shape
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        store_kv_triton(kc, vc, self.rows, self.pos, k.flatten(0, 1), v.flatten(0, 1))  # all S, then attend
        out = decode_attention_triton(q.reshape(B * S, Hq, hd), kc, vc, self.rows, self.lengths, splits=1)
        return out.view(B, S, Hq, hd)


@dataclass
class _Frame:
    """One frame's speculation state, mutated in place (CUDA-graph IF bodies write into it)."""

    codes: Tensor  # [B, K + k + 1] committed codes; columns >= K are a sink for finished rows
    m: Tensor  # [B] last committed codebook
    done: Tensor  # [B] bool: m == K-1 (or a padding row)
    draft: Tensor  # [B, k] drafts of codebooks m+1..m+k
    qprob: Tensor  # [B, k, n] float32 their distributions q


class Speculator:
    """The depth decoder of a frame step with draft/verify over codebooks (see the module docstring)."""

    def __init__(self, model: CSMModel, k: int, max_batch: int, n_codes: int | None = None,
                 conditional_max_batch: int = 128) -> None:
        if k not in SPEC_DEPTHS:
            raise ValueError(f"spec_depth must be in {SPEC_DEPTHS.start}..{SPEC_DEPTHS.stop - 1}, got {k}")
        p = next(model.parameters())
        self.model, self.k, self.cfg = model, k, model.cfg
        K = self.cfg.num_codebooks
        self.n = n_codes or self.cfg.sampleable_codes
        self.kv = DepthKV(self.cfg, max_batch, p.dtype, p.device, positions=K + k + 1)
        self.view = _WriteAt(self.kv)
        self.first_pos = torch.arange(2, device=p.device)  # positions 0, 1: backbone state, codebook 0
        self.offsets = torch.arange(k + 1, device=p.device)  # [k+1]
        # accepted drafts, drafts verified (up to and including the first rejection), codes committed by
        # verify passes, verify passes (x rows): all cumulative, rows that had finished not counted
        self.counts = torch.zeros(4, dtype=torch.long, device=p.device)
        self.draft_rows = torch.arange(max_batch * k, device=p.device) // k
        self.verify_rows = torch.arange(max_batch * (k + 1), device=p.device)
        self.use_triton = p.device.type == "cuda"  # kernels/speculate.py; the torch code here elsewhere
        if self.use_triton:
            model.prepare_heads()  # the gathered-head kernel reads the aligned copy
        self.conditional = p.device.type == "cuda" and conditional_nodes_supported()
        # IF nodes only up to this bucket: each IF body is captured on its own stream, so its activations
        # are never reused by the next pass's (~80 KB per position: 30 passes x B (k+1) positions); and
        # with many rows the slowest one needs nearly every pass anyway
        self.conditional_max_batch = conditional_max_batch
        # benchmarks only: a 0-dim float32 tensor a; every draft is then accepted with probability a
        # instead of by the rule (NOT exact). Read when graphs are captured, so set it before.
        self.forced_acceptance: Tensor | None = None

    # ---- the frame
    def decode_frame(self, h: Tensor, sample: Callable[[Tensor, int], Tensor], params: RowParams,
                     live: Tensor | None = None) -> Tensor:
        """h [B, Db] -> codes [B, K]. `sample(logits, codebook)` is the plain sampler (codebooks 0 and 1);
        `live` [B] bool marks real rows (padding rows are finished from the start)."""
        m_, K, k = self.model, self.cfg.num_codebooks, self.k
        B = h.shape[0]
        c0 = sample(m_.codebook0_head(h), 0)
        x = torch.stack([h, m_.embed_audio(0, c0)], dim=1)  # [B, 2, Db]
        self.view.write = None
        out = m_.decoder(m_.projection(x), self.first_pos.expand(B, 2), self.view)  # [B, 2, Dd]
        c1 = sample(m_.codebook_logits(1, out[:, -1]), 1)
        codes = torch.zeros(B, K + k + 1, dtype=torch.long, device=h.device)
        codes[:, 0], codes[:, 1] = c0, c1
        m = torch.ones(B, dtype=torch.long, device=h.device)
        done = torch.zeros(B, dtype=torch.bool, device=h.device) if live is None else ~live
        if K <= 2:
            done = torch.ones_like(done)
        st = _Frame(codes, m, done, torch.zeros(B, k, dtype=torch.long, device=h.device),
                    torch.zeros(B, k, self.n, dtype=torch.float32, device=h.device))
        self._draft(st, out[:, 1], params)
        capturing = h.is_cuda and torch.cuda.is_current_stream_capturing()
        conditional = capturing and self.conditional and B <= self.conditional_max_batch
        for r in range(K - 2):
            if conditional:
                graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
                graph.begin_capture_to_if_node((~st.done).any())
                try:
                    self._verify(st, params)
                finally:
                    graph.end_capture_to_conditional_node()
            elif capturing:  # large buckets (or CUDA < 12.4): every pass, finished rows as no-ops
                self._verify(st, params)
            else:  # eager: the first pass always runs (it warms up what a graph's IF bodies capture)
                if r > 0 and bool(st.done.all()):
                    break
                self._verify(st, params)
        return st.codes[:, :K]

    # ---- drafts of codebooks m+1..m+k from h_m
    def _draft(self, st: _Frame, h_m: Tensor, params: RowParams, heads: Tensor | None = None,
               cb: Tensor | None = None) -> None:
        """Draft codes and q for every row from h_m [B, Dd]; `heads`/`cb` [B k]: the drafted codebooks'
        head indices and codebooks (CUDA: from the verify kernel; None: from st.m)."""
        K, k, n = self.cfg.num_codebooks, self.k, self.n
        B = h_m.shape[0]
        rows = self.draft_rows[:B * k]  # [B k] the h_m row of each draft
        if cb is None:
            cb = (st.m[:, None] + 1 + self.offsets[:k]).flatten()  # drafted codebooks (> K-1: unused)
            heads = cb.clamp(max=K - 1) - 1
        if self.use_triton:
            from csmserve.kernels.heads import gathered_head_logits
            from csmserve.kernels.speculate import spec_probs

            logits = gathered_head_logits(h_m, self.model.head_t, heads, rows, self.cfg.audio_vocab_size)
            spec_probs(logits[:, :n], *params.fields(), per=k, probs=st.qprob.view(B * k, n),
                       top=torch.empty(B * k, dtype=torch.long, device=h_m.device), codebook=cb,
                       code=st.draft.view(B * k), draw=DRAW_DRAFT)
            return
        logits = self.model.codebook_logits_at(heads + 1, h_m, rows)[:, :n]  # [B k, n]
        xq = sampling_logits(logits, *params.repeat(k)).view(B, k, n)
        noise = hash_uniform_at(params.seed, params.frame, cb.view(B, k), n, DRAW_DRAFT)
        sampled = (xq + gumbel(noise)).argmax(-1)
        greedy = (~(params.temperature >= GREEDY_BELOW))[:, None]  # 0, tiny, NaN: greedy, as the sampler
        st.draft.copy_(torch.where(greedy, logits.view(B, k, n).argmax(-1), sampled))
        st.qprob.copy_(xq.softmax(-1))

    # ---- one verify pass: positions m+1..m+k+1 read c_m, d_{m+1}..d_{m+k}
    def _verify(self, st: _Frame, params: RowParams) -> None:
        if self.use_triton:
            self._verify_triton(st, params)
            return
        m_, K, n, V = self.model, self.cfg.num_codebooks, self.n, self.cfg.audio_vocab_size
        B = st.m.shape[0]
        m = st.m
        cb_in = m[:, None] + self.offsets  # [B, k+1] codebook of each input code
        tok = torch.cat([st.codes.gather(1, m[:, None]), st.draft], 1)  # [B, k+1]
        x = m_.audio_embeddings(tok + cb_in.clamp(max=K - 1) * V)  # [B, k+1, Db]
        pos = cb_in + 1  # [B, k+1] positions, = the codebook each one predicts
        self.view.write = pos
        out = m_.decoder(m_.projection(x), pos.clamp(max=K - 1), self.view)  # [B, k+1, Dd]
        self.view.write = None
        logits = m_.codebook_logits_at(pos.clamp(max=K - 1).flatten(), out.flatten(0, 1))[:, :n]  # [B (k+1), n]
        j = self._verify_torch(st, params, pos, logits)
        h_m = out.gather(1, j[:, None, None].expand(B, 1, out.shape[-1]))[:, 0]  # the new m's hidden state
        self._draft(st, h_m, params)

    def _verify_triton(self, st: _Frame, params: RowParams) -> None:
        """_verify on CUDA: indices, the accept/resample/commit and the drafts' sampling in Triton kernels."""
        from csmserve.kernels.heads import gathered_head_logits
        from csmserve.kernels.speculate import spec_prep, spec_probs, spec_verify

        m_, K, n, V = self.model, self.cfg.num_codebooks, self.n, self.cfg.audio_vocab_size
        B, S = st.m.shape[0], self.k + 1
        emb, wpos, rpos, lengths, heads = spec_prep(st.m, st.codes, st.draft, K, V)
        self.view.prepare(wpos.view(-1), lengths)
        out = m_.decoder(m_.projection(m_.audio_embeddings(emb)), rpos, self.view)  # [B, k+1, Dd]
        self.view.prepared = False
        logits = gathered_head_logits(out.flatten(0, 1), m_.head_t, heads, self.verify_rows[:B * S], V)[:, :n]
        p = torch.empty(B * S, n, dtype=torch.float32, device=out.device)
        top = torch.empty(B * S, dtype=torch.long, device=out.device)
        spec_probs(logits, *params.fields(), per=S, probs=p, top=top)
        j, dheads, dcb = spec_verify(p.view(B, S, n), top.view(B, S), st.qprob, st.draft, st.m, st.done, st.codes,
                                     self.counts, params.temperature, params.seed, params.frame, K,
                                     self.forced_acceptance)
        h_m = out.gather(1, j[:, None, None].expand(B, 1, out.shape[-1]))[:, 0]
        self._draft(st, h_m, params, dheads, dcb)

    def _verify_torch(self, st: _Frame, params: RowParams, pos: Tensor, logits: Tensor) -> Tensor:
        """The reference of kernels/speculate.spec_verify: accept, resample, commit; -> j [B]."""
        K, k, n = self.cfg.num_codebooks, self.k, self.n
        B, m = st.m.shape[0], st.m
        p = sampling_logits(logits, *params.repeat(k + 1)).softmax(-1).view(B, k + 1, n)
        top = logits.view(B, k + 1, n).argmax(-1)  # [B, k+1] greedy targets
        greedy = ~(params.temperature >= GREEDY_BELOW)  # [B]
        d = st.draft
        valid = pos[:, :k] <= K - 1  # [B, k] drafts of existing codebooks
        p_d = p[:, :k].gather(-1, d[..., None])[..., 0]
        q_d = st.qprob.gather(-1, d[..., None])[..., 0]
        u = hash_uniform_at(params.seed, params.frame, pos[:, :k], 1, DRAW_ACCEPT)[..., 0]  # [B, k]
        if self.forced_acceptance is not None:  # benchmarks only
            acc = u < self.forced_acceptance
        else:
            acc = self.accept(p_d, q_d, u, top[:, :k] == d, greedy)
        j = (acc & valid).long().cumprod(1).sum(1)  # [B] drafts accepted in a row

        # the code after them: codebook m+j+1, from the residual (rejected) or from p (all accepted: bonus)
        c_new = m + j + 1
        p_j = p.gather(1, j[:, None, None].expand(B, 1, n))[:, 0]  # [B, n]
        q_j = st.qprob.gather(1, j.clamp(max=k - 1)[:, None, None].expand(B, 1, n))[:, 0]
        new = self.correct(p_j, q_j, j == k, c_new.clamp(max=K - 1), params)
        new = torch.where(greedy, top.gather(1, j[:, None])[:, 0], new)

        st.codes.scatter_(1, m[:, None] + 1 + self.offsets[:k], d)  # drafts past j are overwritten later
        st.codes.scatter_(1, c_new[:, None], new[:, None])  # c_new == K: all drafts to K-1 accepted (sink)
        live = (~st.done).long()
        verified = torch.minimum(j + 1, valid.sum(1))
        committed = j + (c_new <= K - 1).long()
        self.counts.add_(torch.stack([(j * live).sum(), (verified * live).sum(), (committed * live).sum(),
                                      live.sum()]))
        m_next = c_new.clamp(max=K - 1)  # finished rows: K-1 again
        st.m.copy_(m_next)
        st.done.copy_(st.done | (m_next >= K - 1))
        return j

    # ---- the rule (tests swap these for wrong ones to show the distribution test can fail)
    def accept(self, p_d: Tensor, q_d: Tensor, u: Tensor, agree: Tensor, greedy: Tensor) -> Tensor:
        """Accept draft d with probability min(1, p(d)/q(d)); greedy rows while it is p's argmax. [B, k]"""
        return torch.where(greedy[:, None], agree, u * q_d < p_d)

    def correct(self, p: Tensor, q: Tensor, bonus: Tensor, codebook: Tensor, params: RowParams) -> Tensor:
        """The code after the accepted drafts [B]: from max(0, p - q) normalised (rejected), or p (bonus)."""
        r = torch.where(bonus[:, None], p, (p - q).clamp(min=0))
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, p)  # p == q up to rounding: nothing was rejected
        draw = torch.where(bonus, DRAW_PLAIN, DRAW_RESIDUAL)[:, None]
        g = gumbel(hash_uniform_at(params.seed, params.frame, codebook[:, None], self.n, draw))[:, 0]
        return (r.log() + g).argmax(-1)

    # ---- statistics (read without a sync: snapshot() copies them behind the work in flight)
    def snapshot(self) -> "SpecCounts":
        host = torch.zeros(4, dtype=torch.long, pin_memory=self.counts.is_cuda)
        host.copy_(self.counts, non_blocking=True)
        event = None
        if self.counts.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return SpecCounts(host, event)


@dataclass
class SpecCounts:
    """Cumulative draft counts copied from the device; `read()` waits for the copy only."""

    host: Tensor
    event: "torch.cuda.Event | None"

    def read(self) -> dict[str, float]:
        if self.event is not None:
            self.event.synchronize()
        accepted, verified, committed, passes = (int(x) for x in self.host.tolist())
        return {"accepted": accepted, "verified": verified, "committed": committed, "passes": passes,
                "acceptance": accepted / verified if verified else float("nan"),
                "codes_per_pass": committed / passes if passes else float("nan")}
