"""Mimi parity: whole encode/decode vs transformers' MimiModel, streaming vs our whole decode
and vs moshi's streaming decode, per-row resets, streaming encode, loaders. CPU, fast."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from csmserve.models.mimi import Mimi, MimiConfig, MimiStream
from csmserve.models.mimi_loader import (dummy_init, load_hf_state_dict, load_mimi, load_moshi_state_dict,
                                         moshi_to_hf)

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # these tiny models are dominated by op overhead; extra threads only add contention
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _perturb(model: torch.nn.Module, books: tuple[str, str], seed: int) -> None:
    """Random weights with nontrivial layer scales, biases and well-spread codebooks."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(books[0]):
                t.copy_(torch.randn(t.shape, generator=g))
            elif name.endswith(books[1]):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif name.endswith("initialized"):
                t.fill_(1.0)
            elif "scale" in name:
                t.copy_(0.2 + 0.3 * torch.rand(t.shape, generator=g))
            elif t.is_floating_point() and t.dim() == 1:
                t.copy_(0.1 * torch.randn(t.shape, generator=g) + (1.0 if "norm" in name and "weight" in name else 0))


def hf_model(cfg: MimiConfig, seed: int = 0):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    m = tf.MimiModel(tf.MimiConfig(**cfg.hf_kwargs(), attn_implementation="eager")).eval()
    _perturb(m, ("embed_sum", "cluster_usage"), seed)
    return m


def moshi_model(cfg: MimiConfig, seed: int = 0):
    pytest.importorskip("moshi")
    from moshi.models.compression import MimiModel
    from moshi.modules import SEANetDecoder, SEANetEncoder, transformer
    from moshi.quantization import SplitResidualVectorQuantizer

    seanet = dict(channels=1, dimension=cfg.hidden_size, causal=True, n_filters=cfg.num_filters,
                  n_residual_layers=cfg.num_residual_layers, activation="ELU", compress=cfg.compress,
                  dilation_base=cfg.dilation_growth_rate, disable_norm_outer_blocks=0, kernel_size=cfg.kernel_size,
                  residual_kernel_size=cfg.residual_kernel_size, last_kernel_size=cfg.last_kernel_size,
                  norm="none", pad_mode="constant", ratios=list(cfg.upsampling_ratios), true_skip=True)
    tr = dict(d_model=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_layers=cfg.num_hidden_layers,
              causal=True, layer_scale=0.01, context=cfg.sliding_window, conv_layout=True,
              max_period=cfg.rope_theta, gating="none", norm="layer_norm", positional_embedding="rope",
              dim_feedforward=cfg.intermediate_size, input_dimension=cfg.hidden_size,
              output_dimensions=[cfg.hidden_size])
    torch.manual_seed(seed)
    quant = SplitResidualVectorQuantizer(dimension=cfg.codebook_dim, n_q=cfg.num_quantizers, bins=cfg.codebook_size,
                                         input_dimension=cfg.hidden_size, output_dimension=cfg.hidden_size)
    m = MimiModel(SEANetEncoder(**seanet), SEANetDecoder(**seanet), quant, channels=1,
                  sample_rate=cfg.sampling_rate, frame_rate=cfg.frame_rate,
                  encoder_frame_rate=cfg.sampling_rate / cfg.hop_length, causal=True, resample_method="conv",
                  encoder_transformer=transformer.ProjectedTransformer(device="cpu", **tr),
                  decoder_transformer=transformer.ProjectedTransformer(device="cpu", **tr)).eval()
    m.set_num_codebooks(cfg.num_quantizers)
    _perturb(m, ("embedding_sum", "cluster_usage"), seed)
    return m


def ours_from_hf(hf, cfg: MimiConfig, prefix: str = "") -> Mimi:
    mimi = Mimi(cfg)
    load_hf_state_dict(mimi, {prefix + k: v for k, v in hf.state_dict().items()}, prefix)
    return mimi.eval()


def ours_from_moshi(mo, cfg: MimiConfig) -> Mimi:
    mimi = Mimi(cfg)
    load_moshi_state_dict(mimi, mo.state_dict())
    return mimi.eval()


def codes_for(cfg: MimiConfig, b: int, t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.codebook_size, (b, cfg.num_quantizers, t), generator=g)


def stream_decode(mimi: Mimi, codes: torch.Tensor, n: int = 1, **kw) -> torch.Tensor:
    # codes [B, K, T] -> [B, T * frame_size], n frames per step, rows 0..B-1
    st = MimiStream(mimi, codes.shape[0], "decode", max_frames=n, **kw)
    rows = torch.arange(codes.shape[0])
    return torch.cat([st.decode_step(codes[..., i:i + n], rows) for i in range(0, codes.shape[-1], n)], dim=-1)


# --------------------------------------------------------------------------- whole utterance vs HF


@pytest.mark.parametrize("window", [4, 250])
def test_whole_decode_and_encode_match_transformers(window: int) -> None:
    cfg = MimiConfig.tiny(sliding_window=window)
    hf = hf_model(cfg)
    ours = ours_from_hf(hf, cfg)
    codes = codes_for(cfg, 2, 12)
    with torch.no_grad():
        ref = hf.decode(codes).audio_values
        wav = ours.decode(codes)
        assert wav.shape == ref.shape == (2, 1, 12 * cfg.frame_size)
        assert (wav - ref).abs().max().item() <= TOL
        audio = ref * 5  # encode a signal the model made, louder
        ref_codes = hf.encode(audio).audio_codes
        got = ours.encode(audio)
    assert got.shape == ref_codes.shape == (2, cfg.num_quantizers, 12)
    assert torch.equal(got, ref_codes)
    assert got.unique().numel() > 4  # codes are not degenerate
    for cut in (23, 63, 700):  # lengths that are not whole frames: each strided conv completes its window
        with torch.no_grad():
            assert torch.equal(ours.encode(audio[..., cut:]), hf.encode(audio[..., cut:]).audio_codes), cut


def test_csm_prefix_and_tf_nested_names_load() -> None:
    cfg = MimiConfig.tiny()
    hf = hf_model(cfg, seed=3)
    a, b = ours_from_hf(hf, cfg, prefix="codec_model."), ours_from_hf(hf, cfg)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_real_shape_decode_matches_transformers_and_streams() -> None:
    cfg = MimiConfig()
    hf = hf_model(cfg, seed=5)
    ours = ours_from_hf(hf, cfg)
    codes = codes_for(cfg, 1, 3)
    with torch.no_grad():
        ref = hf.decode(codes).audio_values
    wav = ours.decode(codes)
    assert wav.shape == (1, 1, 3 * 1920)
    # these random weights give a peak of ~5, not audio's <= 1: hold fp32 rounding to 1e-5 of the peak
    tol = TOL * max(1.0, ref.abs().max().item())
    assert (wav - ref).abs().max().item() <= tol
    assert (stream_decode(ours, codes) - wav[:, 0]).abs().max().item() <= tol


# --------------------------------------------------------------------------- streaming decode


@pytest.fixture(scope="module")
def moshi_pair():
    cfg = MimiConfig.tiny(sliding_window=6)
    mo = moshi_model(cfg)
    return cfg, mo, ours_from_moshi(mo, cfg)


def test_stream_decode_equals_whole_beyond_window(moshi_pair) -> None:
    cfg, _, ours = moshi_pair
    codes = codes_for(cfg, 2, 170)
    whole = ours.decode(codes)[:, 0]
    for n in (1, 2):
        assert (stream_decode(ours, codes, n) - whole).abs().max().item() <= TOL


def test_stream_decode_equals_moshi_streaming(moshi_pair) -> None:
    cfg, mo, ours = moshi_pair
    codes = codes_for(cfg, 2, 170, seed=2)
    with torch.no_grad(), mo.streaming(2):
        ref = torch.cat([mo.decode(codes[..., i:i + 1]) for i in range(codes.shape[-1])], dim=-1)[:, 0]
    got = stream_decode(ours, codes, 1, moshi_window=True)
    assert (got - ref).abs().max().item() <= TOL
    # Within the window moshi's ring and our exact window agree; beyond it moshi drops one key per frame.
    w = cfg.sliding_window // cfg.latent_stride * cfg.frame_size
    assert (stream_decode(ours, codes[..., :6])[:, :w] - ref[:, :w]).abs().max().item() <= TOL


def test_whole_decode_equals_moshi(moshi_pair) -> None:
    cfg, mo, ours = moshi_pair
    codes = codes_for(cfg, 1, 20, seed=4)
    with torch.no_grad():
        assert (ours.decode(codes) - mo.decode(codes)).abs().max().item() <= TOL


def test_rows_reset_at_different_frames(moshi_pair) -> None:
    cfg, _, ours = moshi_pair
    T, starts, rows = 30, [0, 7, 13], torch.tensor([3, 0, 2])
    codes = codes_for(cfg, 3, T, seed=6)
    st = MimiStream(ours, max_rows=5, part="decode", max_frames=1)
    # earlier streams leave garbage in rows 0 and 2 before they are reset
    st.decode_step(codes_for(cfg, 2, 1, seed=9), torch.tensor([0, 2]))
    outs: list[list[torch.Tensor]] = [[], [], []]
    for t in range(T):
        fresh = [i for i, s in enumerate(starts) if s == t and t > 0]
        if fresh:
            st.reset(rows[fresh])
        live = [i for i, s in enumerate(starts) if t >= s and not (i == 0 and t == 20)]  # row 3 skips frame 20
        pcm = st.decode_step(codes[live, :, t:t + 1], rows[live])
        for j, i in enumerate(live):
            outs[i].append(pcm[j])
    for i, s in enumerate(starts):
        c = codes[i:i + 1, :, s:]
        if i == 0:  # the row that skipped frame 20 equals a stream that never saw it
            c = torch.cat([c[..., :20], c[..., 21:]], dim=-1)
        ref = ours.decode(c)[0, 0]
        assert (torch.cat(outs[i]) - ref).abs().max().item() <= TOL, i


def test_bfloat16_decode_close_to_float32() -> None:
    cfg = MimiConfig.tiny()
    ours = dummy_init(Mimi(cfg))
    codes = codes_for(cfg, 2, 8)
    ref = ours.decode(codes)
    low = ours.to(torch.bfloat16)
    assert low.quantizer.codebooks.dtype == torch.float32
    wav = low.decode(codes)
    assert wav.dtype == torch.bfloat16
    assert (wav.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    assert (stream_decode(low, codes).float() - wav[:, 0].float()).abs().max().item() <= 0.05 * ref.abs().max()


def _kernel_device() -> str:
    """Where the in-place ring attention kernel (Triton) runs: CUDA, or the CPU interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.importorskip("triton")
        return "cpu"
    pytest.skip("the ring attention kernel needs CUDA (or TRITON_INTERPRET=1 with triton installed)")


@pytest.mark.parametrize("moshi_window", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_ring_kernel_equals_gather(moshi_pair, moshi_window: bool, n: int) -> None:
    """kernel=True reads each row's KV ring in place; it must equal the gather + SDPA path, with rows
    starting at different frames, reset rows holding stale keys, and padding rows repeating a spare row."""
    cfg, _, ours = moshi_pair
    dev = _kernel_device()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # fp32 convs on CUDA: no TF32
        _ring_kernel_vs_gather(cfg, copy.deepcopy(ours).to(dev), dev, moshi_window, n)


def _ring_kernel_vs_gather(cfg: MimiConfig, model: Mimi, dev: str, moshi_window: bool, n: int) -> None:
    T, starts, rows = 24, [0, 4, 10], torch.tensor([3, 0, 2], device=dev)
    codes = codes_for(cfg, 3, T, seed=12).to(dev)
    streams = {k: MimiStream(model, 5, "decode", max_frames=n, moshi_window=moshi_window, kernel=k)
               for k in (False, True)}
    assert streams[True].kernel and not streams[False].kernel
    outs = {k: [] for k in streams}
    for k, st in streams.items():
        st.decode_step(codes_for(cfg, 2, n, seed=9).to(dev), torch.tensor([0, 2], device=dev))  # stale state
        for t in range(0, T, n):
            fresh = [i for i, s in enumerate(starts) if s == t and t > 0]
            if fresh:
                st.reset(rows[fresh])
            live = [i for i, s in enumerate(starts) if t >= s]
            spare = torch.full((2,), 4, device=dev)  # a graph bucket's padding: the spare row, twice
            pcm = st.decode_step(torch.cat([codes[live, :, t:t + n], codes[:2, :, t:t + n]]),
                                 torch.cat([rows[live], spare]))
            outs[k].append((live, pcm[: len(live)]))
    for (live, a), (_, b) in zip(outs[False], outs[True]):
        assert (a - b).abs().max().item() <= TOL, live
    if not moshi_window:  # and both equal whole decode
        ref = model.decode(codes[2:3, :, 10:])[0, 0]
        got = torch.cat([pcm[live.index(2)] for live, pcm in outs[True] if 2 in live])
        assert (got - ref).abs().max().item() <= TOL


def test_ring_kernel_stream_encode_equals_whole() -> None:
    dev = _kernel_device()
    cfg = MimiConfig.tiny(sliding_window=6)
    ours = dummy_init(Mimi(cfg)).to(dev)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        wav = 5 * ours.decode(codes_for(cfg, 2, 24, seed=7).to(dev))
        whole = ours.encode(wav)
        fs, rows = cfg.frame_size, torch.tensor([2, 0], device=dev)
        for n in (1, 3):
            st = MimiStream(ours, max_rows=3, part="encode", max_frames=n, kernel=True)
            st.encode_step(wav[..., :fs].flip(0), rows)
            st.reset(rows)
            got = torch.cat([st.encode_step(wav[..., i * fs:(i + n) * fs], rows) for i in range(0, 24, n)], dim=-1)
            assert torch.equal(got, whole), n


def test_ring_kernel_bfloat16_close() -> None:
    dev = _kernel_device()
    if dev == "cpu":
        pytest.skip("triton's interpreter has no bfloat16")
    cfg = MimiConfig(num_hidden_layers=2)
    model = dummy_init(Mimi(cfg)).to(dev, torch.bfloat16).eval()
    codes = codes_for(cfg, 3, 8).to(dev)
    rows = torch.tensor([0, 2, 1], device=dev)
    got = {}
    for k in (False, True):
        st = MimiStream(model, 3, "decode", max_frames=1, kernel=k)
        got[k] = torch.cat([st.decode_step(codes[..., i:i + 1], rows) for i in range(8)], -1).float()
    assert (got[True] - got[False]).abs().max().item() <= 0.02 * got[False].abs().max().item()


def test_kernel_off_without_cuda() -> None:
    ours = dummy_init(Mimi(MimiConfig.tiny()))
    assert not MimiStream(ours, 2, "decode", max_frames=1).kernel  # state on the CPU: the gather path


# --------------------------------------------------------------------------- streaming encode


def test_stream_encode_equals_whole_encode() -> None:
    cfg = MimiConfig.tiny(sliding_window=6)
    ours = dummy_init(Mimi(cfg))
    wav = 5 * ours.decode(codes_for(cfg, 2, 24, seed=7))
    whole = ours.encode(wav)
    fs = cfg.frame_size
    for n in (1, 3):
        st = MimiStream(ours, max_rows=3, part="encode", max_frames=n)
        rows = torch.tensor([2, 0])
        st.encode_step(wav[..., :fs].flip(0), rows)  # a previous stream in these rows
        st.reset(rows)
        got = torch.cat([st.encode_step(wav[..., i * fs:(i + n) * fs], rows) for i in range(0, 24, n)], dim=-1)
        assert torch.equal(got, whole)
    assert whole.unique().numel() > 4


def test_stream_encode_matches_transformers() -> None:
    cfg = MimiConfig.tiny()
    hf = hf_model(cfg, seed=8)
    ours = ours_from_hf(hf, cfg)
    wav = 5 * ours.decode(codes_for(cfg, 1, 10))
    with torch.no_grad():
        ref = hf.encode(wav).audio_codes
    st = MimiStream(ours, 1, "encode", max_frames=1)
    fs, rows = cfg.frame_size, torch.tensor([0])
    got = torch.cat([st.encode_step(wav[..., i * fs:(i + 1) * fs], rows) for i in range(10)], dim=-1)
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------- loaders


def test_loader_names_bad_tensors() -> None:
    cfg = MimiConfig.tiny()
    sd = hf_model(cfg).state_dict()
    bad = dict(sd)
    bad.pop("decoder.decoder_seanet.layers.0.conv.bias")
    with pytest.raises(ValueError, match="decoder.0.bias"):
        load_hf_state_dict(Mimi(cfg), bad)
    bad = dict(sd, **{"decoder.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="decoder.extra.weight"):
        load_hf_state_dict(Mimi(cfg), bad)
    bad = dict(sd, **{"encoder.downsample.conv.weight": torch.zeros(3, 3, 4)})
    with pytest.raises(ValueError, match="downsample.weight"):
        load_hf_state_dict(Mimi(cfg), bad)
    bad = {k: v for k, v in sd.items() if "acoustic_residual_vector_quantizer.layers.2.codebook.embed" not in k}
    with pytest.raises(ValueError, match="codebook"):
        load_hf_state_dict(Mimi(cfg), bad)


def test_moshi_layout_both_versions_and_files(moshi_pair, tmp_path) -> None:
    from safetensors.torch import save_file

    cfg, mo, ours = moshi_pair
    old = {k.replace("in_projs.0.weight", "in_proj_weight").replace("out_projs.0.", "out_proj."): v
           for k, v in mo.state_dict().items()}  # moshi 0.2.2 names
    a = Mimi(cfg)
    load_moshi_state_dict(a, old)
    for (k, v), (_, w) in zip(a.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(v, w), k
    save_file({k: v.contiguous() for k, v in old.items()}, str(tmp_path / "tok.safetensors"))
    b = load_mimi(tmp_path / "tok.safetensors", cfg)
    codes = codes_for(cfg, 1, 3)
    # the same weights decode the same (to the last bits but one: BLAS may take another path by alignment)
    torch.testing.assert_close(b.decode(codes), ours.decode(codes), atol=1e-6, rtol=1e-6)
    hf_names = moshi_to_hf(mo.state_dict(), cfg)
    save_file({"codec_model." + k: v.contiguous() for k, v in hf_names.items()}, str(tmp_path / "csm.safetensors"))
    c = load_mimi(tmp_path / "csm.safetensors", cfg, dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16 and c.quantizer.codebooks.dtype == torch.float32


def test_dummy_real_shape() -> None:
    m = load_mimi("dummy")
    assert sum(p.numel() for p in m.parameters()) == 79_308_609
    assert m.quantizer.codebooks.shape == (32, 2048, 256)


def test_bench_smoke() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "bench" / "mimi_decode.py"), "--device", "cpu", "--tiny", "--frames", "2",
           "--batches", "1,2", "--iters", "1", "--warmup", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.count("\n| ") >= 3 and "stream step eager" in out


def test_load_saved_transformers_dir(tmp_path) -> None:
    cfg = MimiConfig.tiny(sliding_window=5)
    hf = hf_model(cfg, seed=11)
    hf.save_pretrained(tmp_path)
    ours = load_mimi(tmp_path)
    assert ours.cfg == cfg
    codes = codes_for(cfg, 1, 4)
    with torch.no_grad():
        assert (ours.decode(codes) - hf.decode(codes).audio_values).abs().max().item() <= TOL


def test_transposed_conv_fast_paths_equal_conv_transpose1d():
    """The upsample's depthwise ConvTranspose1d is a broadcast product and an overlap-add (cuDNN's grouped
    kernel is slow at large batch): the same numbers as F.conv_transpose1d, with and without bias."""
    import torch.nn.functional as F

    from csmserve.models.mimi_layers import CausalConvTr

    torch.manual_seed(0)
    for C, k, s, T, bias in [(16, 4, 2, 1, False), (16, 4, 2, 5, True), (8, 6, 3, 4, True), (8, 6, 2, 3, False)]:
        m = CausalConvTr(C, C, k, stride=s, groups=C, bias=bias)
        torch.nn.init.normal_(m.weight)
        if bias:
            torch.nn.init.normal_(m.bias)
        x = torch.randn(3, C, T)
        torch.testing.assert_close(m._transposed(x), F.conv_transpose1d(x, m.weight, m.bias, s, groups=C),
                                   atol=1e-5, rtol=1e-5)
