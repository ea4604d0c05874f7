"""GPU (`pytest -m gpu`): the frame step's prologue and epilogue kernels (kernels/frame_io.py) against the
torch ops they replace (runner.frame_step without fuse: the CPU path). Also runs on the CPU under Triton's
interpreter (TRITON_INTERPRET=1 with a Triton whose interpreter works with the installed numpy)."""
import os

import pytest
import torch

from csmserve.engine.slots import SlotState
from csmserve.models.csm import CSMConfig, CSMModel, llama_1b, llama_100m

pytestmark = pytest.mark.gpu
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
run = pytest.mark.skipif(DEV != "cuda" and not INTERPRET, reason="needs CUDA (or TRITON_INTERPRET=1)")
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16


def _state(cfg, n_slots, seed=0):
    """A slot pool with random inputs: audio frames, text frames (only the text column on) and a mix."""
    g = torch.Generator().manual_seed(seed)
    s = SlotState(cfg, n_slots, torch.device(DEV))
    K, V, W = cfg.num_codebooks, cfg.audio_vocab_size, cfg.frame_width
    tok = torch.randint(0, V, (n_slots + 1, W), generator=g)
    tok[:, K] = torch.randint(0, cfg.text_vocab_size, (n_slots + 1,), generator=g)
    mask = torch.rand(n_slots + 1, W, generator=g) < 0.7
    mask[0::3, :K], mask[0::3, K] = False, True  # text frames
    mask[1::3, :K], mask[1::3, K] = True, False  # audio frames
    s.next_tokens.copy_(tok)
    s.next_mask.copy_(mask)
    s.pos.copy_(torch.randint(0, 500, (n_slots + 1,), generator=g))
    s.frame.copy_(torch.randint(0, 100, (n_slots + 1,), generator=g))
    s.temperature.copy_(torch.rand(n_slots + 1, generator=g))
    s.top_k.copy_(torch.randint(0, 60, (n_slots + 1,), generator=g))
    s.top_p.copy_(torch.rand(n_slots + 1, generator=g))
    s.seed.copy_(torch.randint(0, 2**62, (n_slots + 1,), generator=g))
    return s


def _model(cfg, dtype):
    torch.manual_seed(0)
    return CSMModel(cfg).to(DEV, dtype)


def _tiny():
    from csmserve.models.llama import LlamaConfig

    return CSMConfig(backbone=LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate=128),
                     decoder=LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=64),
                     text_vocab_size=300, audio_vocab_size=40, num_codebooks=8, max_seq_len=512)


CONFIGS = [("tiny", _tiny)]
if DEV == "cuda":  # the real shape: D 2,048, 32 codebooks of 2,051 codes, a 128,256-token text table
    CONFIGS.append(("real", lambda: CSMConfig(backbone=llama_1b(), decoder=llama_100m())))


@run
@pytest.mark.parametrize("name,make", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [[3], [0, 1, 2, 5], [4, 7, 7, 7]])  # 7: the scratch slot (padding rows)
def test_prologue_equals_the_gathers_and_embed_frames(name, make, dtype, rows):
    from csmserve.kernels.frame_io import prologue_triton

    cfg = make()
    m = _model(cfg, dtype)
    s = _state(cfg, 7)
    ids = torch.tensor(rows, device=DEV)
    fi = prologue_triton(s, ids, m.audio_embeddings.weight, m.text_embeddings.weight, cfg.num_codebooks,
                         cfg.audio_vocab_size)
    ref = m.embed_frames(s.next_tokens[ids][:, None], s.next_mask[ids][:, None])  # [B, 1, D]
    assert fi.x.shape == ref.shape and fi.x.dtype == ref.dtype
    # the same terms, rounded at the same points; only the order of the float32 sum of the audio columns may differ
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fi.x, ref, atol=tol, rtol=tol)
    assert torch.equal(fi.pos, s.pos[ids]) and torch.equal(fi.lengths, (s.pos[ids] + 1).int())
    for got, want in [(fi.temperature, s.temperature), (fi.top_k, s.top_k), (fi.top_p, s.top_p), (fi.seed, s.seed),
                      (fi.frame, s.frame)]:
        assert got.dtype == want.dtype and torch.equal(got, want[ids])
    # without the embedding (a first frame from the prefill's hidden state): the same gathers, no x
    ne = prologue_triton(s, ids, m.audio_embeddings.weight, m.text_embeddings.weight, cfg.num_codebooks,
                         cfg.audio_vocab_size, embed=False)
    assert ne.x is None
    for got, want in zip(ne[1:], fi[1:]):
        assert torch.equal(got, want)
    # a frame with every column off embeds to zeros; text alone to its text row
    s.next_mask[ids[0]] = False
    s.next_mask[ids[0], cfg.num_codebooks] = True
    fi = prologue_triton(s, ids, m.audio_embeddings.weight, m.text_embeddings.weight, cfg.num_codebooks,
                         cfg.audio_vocab_size)
    assert torch.equal(fi.x[0, 0], m.text_embeddings.weight[s.next_tokens[ids[0], cfg.num_codebooks]])


@run
@pytest.mark.parametrize("rows", [[3], [0, 1, 2, 5], [4, 6, 7, 7]])
def test_epilogue_equals_the_torch_updates(rows):
    from csmserve.kernels.frame_io import epilogue_triton

    cfg, scratch, max_pos = _tiny(), 7, 400
    s, ref = _state(cfg, scratch), _state(cfg, scratch)
    ids = torch.tensor(rows, device=DEV)
    K = cfg.num_codebooks
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, cfg.audio_vocab_size, (len(rows), K), generator=g).to(DEV)
    codes_strided = torch.cat([codes, codes], 1)[:, :K]  # a row stride that is not K
    s.pos[4] = ref.pos[4] = max_pos  # at the end of the sequence: clamped
    pos, frame = s.pos[ids].clone(), s.frame[ids].clone()
    epilogue_triton(s, ids, codes_strided, pos, frame, scratch, max_pos)
    live = ids != scratch
    ref.next_tokens[ids] = torch.cat([codes, torch.zeros_like(codes[:, :1])], 1)
    ref.next_mask[ids] = torch.tensor([True] * K + [False], device=DEV).expand(len(rows), -1)
    ref.pos[ids] = torch.where(live, (pos + 1).clamp(max=max_pos), 0)
    ref.frame[ids] = torch.where(live, frame + 1, 0)
    keep = torch.arange(scratch + 1, device=DEV) != scratch  # padding rows all write scratch: any of them may win
    for a, b in [(s.next_tokens, ref.next_tokens), (s.next_mask, ref.next_mask), (s.pos, ref.pos),
                 (s.frame, ref.frame)]:
        assert torch.equal(a[keep], b[keep])
    assert int(s.pos[scratch]) == (0 if scratch in rows else int(ref.pos[scratch]))
    if 4 in rows:
        assert int(s.pos[4]) == max_pos
