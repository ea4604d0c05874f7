"""The frame step's prologue and epilogue, one kernel each (CUDA): what were ~20 small torch kernels.

prologue: each row's slot -> its input embedding (the masked sum of its 33 column embeddings, as
CSMModel.embed_frames), its position, its attention length and its sampling parameters, gathered from the
slot pool (engine/slots.py SlotState). epilogue: each row's generated codes -> its slot's next input (the
codes, an empty text column, the audio mask), position + 1 (clamped) and frame + 1; padding rows (the
scratch slot) get 0. Both are launched with PDL (kernels/pdl.py): the prologue lets the backbone's first
GEMV launch at once; the epilogue waits for the codes before it reads or writes anything.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from csmserve.kernels import pdl


@triton.jit
def _prologue_kernel(SLOTS, TOK, MASK, POS, TEMP, TOPK, TOPP, SEED, FRAME, AUDIO, TEXT, X,
                     POS_O, LEN_O, TEMP_O, TOPK_O, TOPP_O, SEED_O, FRAME_O,
                     W, K, V, D, stride_x, BLOCK_D: tl.constexpr, EMBED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py: the first kernel of the frame; the backbone's first GEMV may launch now
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    pd = tl.program_id(1)
    slot = tl.load(SLOTS + b)
    if EMBED:  # False: a first frame from the prefill's hidden state, which needs no input embedding
        d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c in range(K):  # the audio columns summed first, in float32, rounded once (as `.sum(2)` does)
            t = tl.load(TOK + slot * W + c)
            m = tl.load(MASK + slot * W + c) != 0
            e = tl.load(AUDIO + (t + c * V) * D + d, mask=dm & m, other=0.0)
            acc += e.to(tl.float32)
        audio = acc.to(X.dtype.element_ty)
        t = tl.load(TOK + slot * W + K)
        m = tl.load(MASK + slot * W + K) != 0
        text = tl.load(TEXT + t * D + d, mask=dm & m, other=0.0)
        tl.store(X + b * stride_x + d, (audio.to(tl.float32) + text.to(tl.float32)).to(X.dtype.element_ty), mask=dm)
    if pd == 0:
        p = tl.load(POS + slot)
        tl.store(POS_O + b, p)
        tl.store(LEN_O + b, (p + 1).to(tl.int32))
        tl.store(TEMP_O + b, tl.load(TEMP + slot))
        tl.store(TOPK_O + b, tl.load(TOPK + slot))
        tl.store(TOPP_O + b, tl.load(TOPP + slot))
        tl.store(SEED_O + b, tl.load(SEED + slot))
        tl.store(FRAME_O + b, tl.load(FRAME + slot))


@triton.jit
def _epilogue_kernel(SLOTS, CODES, POS_I, FRAME_I, TOK, MASK, POS, FRAME, stride_c, scratch, max_pos, W, K,
                     BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    slot = tl.load(SLOTS + b)
    live = slot != scratch
    c = tl.arange(0, BLOCK_W)
    code = tl.load(CODES + b * stride_c + c, mask=c < K, other=0)
    tl.store(TOK + slot * W + c, code, mask=c < W)
    tl.store(MASK + slot * W + c, (c < K).to(tl.int8), mask=c < W)
    p = tl.load(POS_I + b)
    tl.store(POS + slot, tl.where(live, tl.minimum(p + 1, max_pos), 0))
    f = tl.load(FRAME_I + b)
    tl.store(FRAME + slot, tl.where(live, f + 1, 0))


class FrameInputs(NamedTuple):
    """One frame step's gathered inputs: x [B, 1, D] (None without embed), pos [B] int64, lengths [B] int32
    (pos + 1), and the sampling parameters temperature, top_k, top_p, seed, frame [B]."""

    x: Tensor | None
    pos: Tensor
    lengths: Tensor
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    seed: Tensor
    frame: Tensor


def prologue_triton(state, slot_ids: Tensor, audio: Tensor, text: Tensor, num_codebooks: int,
                    audio_vocab: int, embed: bool = True) -> FrameInputs:
    """state: SlotState; slot_ids [B]; audio [K * V, D], text [text_vocab, D] the embedding tables; embed=False:
    no input embedding (x None; one program per row)."""
    B, D = slot_ids.shape[0], audio.shape[1]
    dev = slot_ids.device
    x = torch.empty(B, 1, D, dtype=audio.dtype, device=dev) if embed else None
    pos = torch.empty(B, dtype=torch.int64, device=dev)
    lengths = torch.empty(B, dtype=torch.int32, device=dev)
    temp, top_k, top_p = torch.empty_like(pos, dtype=torch.float32), torch.empty_like(pos), torch.empty_like(
        pos, dtype=torch.float32)
    seed, frame = torch.empty_like(pos), torch.empty_like(pos)
    BLOCK_D = 512
    W = state.next_tokens.shape[1]
    out = x if embed else audio  # never written without embed
    _prologue_kernel[(B, triton.cdiv(D, BLOCK_D) if embed else 1)](
        slot_ids, state.next_tokens, state.next_mask.view(torch.int8), state.pos, state.temperature, state.top_k,
        state.top_p, state.seed, state.frame, audio, text, out, pos, lengths, temp, top_k, top_p, seed, frame,
        W, num_codebooks, audio_vocab, D, out.stride(0), BLOCK_D=BLOCK_D, EMBED=embed, num_warps=4, **pdl.opts())
    return FrameInputs(x, pos, lengths, temp, top_k, top_p, seed, frame)


def epilogue_triton(state, slot_ids: Tensor, codes: Tensor, pos: Tensor, frame: Tensor, scratch: int,
                    max_pos: int) -> None:
    """codes [B, K] of the frame -> the slots' next inputs; pos, frame [B]: the rows' gathered values."""
    B, K = codes.shape
    W = state.next_tokens.shape[1]
    _epilogue_kernel[(B,)](slot_ids, codes, pos, frame, state.next_tokens, state.next_mask.view(torch.int8),
                           state.pos, state.frame, codes.stride(0), scratch, max_pos, W, K,
                           BLOCK_W=triton.next_power_of_2(W), num_warps=1, **pdl.opts())
