"""The channels-last SEANet decoder (models/mimi_decoder.py) against the conv layout: same audio, per
row, streaming and whole, the real shape and configs with several residual layers. CPU, float32."""
from __future__ import annotations

import pytest
import torch

from csmserve.models.mimi import Mimi, MimiConfig, MimiStream
from csmserve.models.mimi_decoder import ChannelsLastDecoder
from csmserve.models.mimi_loader import dummy_init

from tests.models.test_mimi import TOL, codes_for


def _model(cfg: MimiConfig, seed: int = 0) -> Mimi:
    torch.manual_seed(seed)
    mimi = dummy_init(Mimi(cfg)).eval()
    with torch.no_grad():  # biases nonzero so the folded biases are tested
        for name, p in mimi.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return mimi


def _stream(mimi: Mimi, codes: torch.Tensor, layout: str, n: int = 1, rows: torch.Tensor | None = None,
            max_rows: int | None = None) -> torch.Tensor:
    B = codes.shape[0]
    rows = torch.arange(B) if rows is None else rows
    st = MimiStream(mimi, max_rows or B, "decode", max_frames=n, layout=layout)
    return torch.cat([st.decode_step(codes[..., i:i + n], rows) for i in range(0, codes.shape[-1], n)], dim=-1)


CONFIGS = {
    "tiny": MimiConfig.tiny(),
    "two residual layers, dilated": MimiConfig.tiny(num_residual_layers=2, dilation_growth_rate=3),
    "odd ratios": MimiConfig.tiny(upsampling_ratios=(5, 3), kernel_size=5, last_kernel_size=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n", [1, 2])
def test_layouts_stream_the_same_audio(name: str, n: int) -> None:
    cfg = CONFIGS[name]
    mimi = _model(cfg)
    codes = codes_for(cfg, 3, 12)
    whole = mimi.decode(codes)[:, 0]
    cl, nct = _stream(mimi, codes, "cl", n), _stream(mimi, codes, "nct", n)
    scale = max(1.0, whole.abs().max().item())
    assert (cl - nct).abs().max().item() <= TOL * scale
    assert (cl - whole).abs().max().item() <= TOL * scale


def test_whole_mode_equals_the_conv_layout() -> None:
    cfg = MimiConfig.tiny()
    mimi = _model(cfg, seed=3)
    codes = codes_for(cfg, 2, 9, seed=2)
    with torch.no_grad():
        x = mimi.decoder_input(codes)  # [B, D, T]
        got = ChannelsLastDecoder(mimi.decoder)(x.transpose(1, 2).contiguous())
        ref = mimi.decode(codes)[:, 0]
    assert (got - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())


def test_rows_are_independent_and_reset() -> None:
    """Rows in any order and subset, a row reset mid-way: each equals its own stream alone."""
    cfg = MimiConfig.tiny()
    mimi = _model(cfg, seed=1)
    codes = codes_for(cfg, 2, 10, seed=5)
    st = MimiStream(mimi, 6, "decode", max_frames=1, layout="cl")
    st.decode_step(codes_for(cfg, 2, 1, seed=9), torch.tensor([4, 1]))  # garbage in row 4, then reset
    st.reset(torch.tensor([4]))
    out: list[list[torch.Tensor]] = [[], []]
    for t in range(10):
        rows = torch.tensor([4, 2]) if t % 2 else torch.tensor([2, 4])
        order = [0, 1] if t % 2 else [1, 0]
        pcm = st.decode_step(codes[order, :, t:t + 1], rows)
        for j, i in enumerate(order):
            out[i].append(pcm[j])
    for i in range(2):
        ref = mimi.decode(codes[i:i + 1])[0, 0]
        assert (torch.cat(out[i]) - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), i


def test_real_shape_layouts_agree() -> None:
    cfg = MimiConfig()
    mimi = _model(cfg, seed=7)
    codes = codes_for(cfg, 2, 3, seed=3)
    cl, nct = _stream(mimi, codes, "cl"), _stream(mimi, codes, "nct")
    assert cl.shape == (2, 3 * cfg.frame_size)
    assert (cl - nct).abs().max().item() <= TOL * max(1.0, nct.abs().max().item())


def test_bfloat16_close_to_float32() -> None:
    cfg = MimiConfig.tiny()
    mimi = _model(cfg, seed=2)
    codes = codes_for(cfg, 2, 8)
    ref = _stream(mimi, codes, "nct")
    low = _stream(mimi.to(torch.bfloat16), codes, "cl")
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_state_is_rows_of_inputs_and_layout_checked() -> None:
    mimi = _model(MimiConfig.tiny())
    st = MimiStream(mimi, 3, "decode", max_frames=1, layout="cl")
    keys = [k for k in st.bufs if k.startswith("decoder_cl.")]
    assert keys and not any(k.startswith("decoder.") for k in st.bufs)
    assert st.bufs["decoder_cl.0"].shape == (3, mimi.cfg.kernel_size - 1, mimi.cfg.hidden_size)
    with pytest.raises(ValueError, match="layout"):
        MimiStream(mimi, 3, "decode", layout="nhwc")
