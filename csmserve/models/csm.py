"""CSM: frame embeddings, the Llama backbone, codebook-0 head, projection, depth decoder, codebook heads.

A frame is 33 columns: codebooks 0..K-1 then one text token, with a 33-column mask; its input
embedding is the masked sum of the column embeddings. One generated frame = one backbone position
+ K-1 depth-decoder steps (spec §1.4-1.5).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from csmserve.models import llama
from csmserve.models.llama import KVView, Llama, LlamaConfig


def llama_1b() -> LlamaConfig:
    return LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate=8192)


def llama_100m() -> LlamaConfig:
    return LlamaConfig(dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, intermediate=8192)


@dataclass(frozen=True)
class CSMConfig:
    backbone: LlamaConfig = field(default_factory=llama_1b)
    decoder: LlamaConfig = field(default_factory=llama_100m)
    text_vocab_size: int = 128_256
    audio_vocab_size: int = 2051
    num_codebooks: int = 32
    max_seq_len: int = 2048  # backbone positions

    @property
    def frame_width(self) -> int:
        return self.num_codebooks + 1

    @property
    def sampleable_codes(self) -> int:
        # the real vocab's ids 2048..2050 are unused and Mimi cannot decode them: never sample them
        return 2048 if self.audio_vocab_size == 2051 else self.audio_vocab_size


# sample(logits [B, V], codebook index) -> codes [B] int64
Sampler = Callable[[Tensor, int], Tensor]


def _embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding(n, dim) with its own N(0, 1) init, skipped on the meta device (loader.empty_model):
    normal_ on meta imports torch._dynamo and sympy, ~2 s in every process that builds a model."""
    w = torch.empty(n, dim)
    if not w.is_meta:
        nn.init.normal_(w)
    return nn.Embedding(n, dim, _weight=w)


class CSMModel(nn.Module):
    def __init__(self, cfg: CSMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        K, V, Db, Dd = cfg.num_codebooks, cfg.audio_vocab_size, cfg.backbone.dim, cfg.decoder.dim
        self.text_embeddings = _embedding(cfg.text_vocab_size, Db)
        self.audio_embeddings = _embedding(V * K, Db)  # row = code + codebook * V
        self.backbone = Llama(cfg.backbone)
        self.decoder = Llama(cfg.decoder)
        self.projection = nn.Linear(Db, Dd, bias=False)
        self.codebook0_head = nn.Linear(Db, V, bias=False)
        self.audio_head = nn.Parameter(torch.empty(K - 1, Dd, V))  # codebook i>=1 uses [i-1]
        self.register_buffer("codebook_offsets", torch.arange(K, device="cpu") * V, persistent=False)  # [K] (not on meta: see _embedding)
        self.head_t: Tensor | None = None  # [K-1, Vp, Dd] aligned copy of audio_head (prepare_heads)

    def embed_frames(self, tokens: Tensor, mask: Tensor) -> Tensor:
        # tokens, mask [B, S, 33] -> [B, S, Db]; audio columns summed first (32 terms, as HF does)
        K = self.cfg.num_codebooks
        m = mask.to(self.text_embeddings.weight.dtype)
        audio = self.audio_embeddings(tokens[..., :K] + self.codebook_offsets)  # [B, S, K, Db]
        text = self.text_embeddings(tokens[..., K])  # [B, S, Db]
        return (audio * m[..., :K, None]).sum(2) + text * m[..., K, None]

    def audio_table(self, codebook: int) -> Tensor:
        # codebook's rows of the embedding table [V, Db] (a view): a gather per depth step, no offset add before it
        V = self.cfg.audio_vocab_size
        return self.audio_embeddings.weight[codebook * V:(codebook + 1) * V]

    def embed_audio(self, codebook: int, codes: Tensor) -> Tensor:
        return F.embedding(codes, self.audio_table(codebook))

    def forward_backbone(self, tokens: Tensor, mask: Tensor, pos: Tensor, kv: KVView) -> Tensor:
        """tokens/mask [B, S, 33], pos [B, S] -> final-normed hidden states [B, S, Db]."""
        return self.backbone(self.embed_frames(tokens, mask), pos, kv)

    def codebook_logits(self, codebook: int, h_dec: Tensor) -> Tensor:
        # h_dec [B, Dd] -> [B, V]
        if self.head_t is not None:
            return llama.matmul_t(h_dec, self.head_t[codebook - 1])[:, : self.cfg.audio_vocab_size]
        return h_dec @ self.audio_head[codebook - 1]

    def codebook_logits_unnormed(self, codebook: int, x: Tensor, delta: Tensor) -> Tensor:
        """codebook_logits of the depth decoder's final norm of x + delta [B, Dd] (Llama.forward's normed=False):
        the add + norm in the head's GEMV (llama.norm_matmul_t) where the heads are prepared."""
        if self.head_t is not None:
            V = self.cfg.audio_vocab_size
            return llama.norm_matmul_t(x, delta, self.decoder.norm, self.head_t[codebook - 1])[:, :V]
        n = self.decoder.norm
        return self.codebook_logits(codebook, llama.add_rms_norm(x, delta, n.weight, n.eps)[1])

    @torch.no_grad()
    def prepare_heads(self, multiple: int = 64) -> None:
        """Transposed codebook heads with the vocab padded to `multiple`: 2051 columns make GEMMs fall
        back to unaligned kernels on CUDA. Costs one extra copy of the heads (130 MB in bf16)."""
        if self.head_t is not None:  # captured graphs may already read it: never replace it
            return
        V = self.cfg.audio_vocab_size
        pad = -V % multiple
        self.head_t = F.pad(self.audio_head.transpose(1, 2), (0, 0, 0, pad)).contiguous()

    def decode_frame(self, h: Tensor, sample: Sampler, kv: KVView, pos: Tensor) -> Tensor:
        """One frame's K codes from the backbone's last hidden state h [B, Db].

        `kv` is a depth-decoder view of K positions, fresh for this frame; `pos` is arange(K) [K]
        on h's device. Returns codes [B, K] int64.
        """
        B = h.shape[0]
        c = sample(llama.linear(h, self.codebook0_head), 0)
        codes = [c]
        x = torch.stack([h, self.embed_audio(0, c)], dim=1)  # [B, 2, Db]
        p = pos[:2].expand(B, 2)
        n = self.cfg.num_codebooks
        y = llama.linear(x, self.projection)  # [B, 2, Dd]
        for i in range(1, n):
            out, delta = self.decoder(y, p, kv, normed=False)  # [B, S, Dd] each: the final norm is in the head's GEMV
            c = sample(self.codebook_logits_unnormed(i, out[:, -1], delta[:, -1]), i)
            codes.append(c)
            if i + 1 < n:  # codebook i's code enters at decoder position i+1, gathered in the projection's GEMV
                y = llama.embed_linear(c, self.audio_table(i), self.projection)[:, None]  # [B, 1, Dd]
                p = pos[i + 1 : i + 2].expand(B, 1)
        return torch.stack(codes, dim=1)
