"""CPU: the depth weights' pack for L2 residency (engine/residency.py): same values, one allocation in window order,
the modules' own parameters rebound, packed once per model; the window's size rule. The driver side: *_gpu.py."""
import pytest
import torch

from csmserve.engine.residency import ALIGN, L2Residency, depth_weights, pack, window_bytes
from csmserve.models.fp8 import quantize_weights
from tests.engine.test_runner_gpu import tiny_model as _tiny


def tiny_model():
    return _tiny(torch.float32, "cpu")


def test_window_order_is_every_o_and_qkv_then_the_projection_then_down_then_gate_up():
    m = tiny_model()
    mods = [mod for mod, _ in depth_weights(m)]
    layers = m.decoder.layers
    L = len(layers)
    assert mods[:L] == [b.self_attn.o_proj for b in layers]
    assert mods[L:2 * L] == [b.self_attn.qkv_proj for b in layers]
    assert mods[2 * L] is m.projection
    assert mods[2 * L + 1:3 * L + 1] == [b.mlp.down_proj for b in layers]
    assert mods[3 * L + 1:] == [b.mlp.gate_up_proj for b in layers]


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_pack_keeps_values_and_parameters_and_lays_them_out_in_order(weights):
    m = tiny_model()
    quantize_weights(m, weights)
    entries = depth_weights(m)
    names = {n for _, n in entries}
    assert names == ({"weight"} if weights == "bf16" else {"weight8"})
    before = [getattr(mod, n).clone() for mod, n in entries]
    params = [mod._parameters.get(n) for mod, n in entries]
    x = torch.randn(2, m.cfg.backbone.dim)
    ref = m.projection(x)
    flat = pack(entries, torch.device("cpu"))
    off = 0
    for (mod, n), b, p in zip(entries, before, params):
        t = getattr(mod, n)
        assert torch.equal(t.float(), b.float()) and t.dtype == b.dtype and t.shape == b.shape
        assert t.data_ptr() == flat.data_ptr() + off, "each weight at its place in the window's order"
        assert off % ALIGN == 0 and t.is_contiguous()
        if p is not None:
            assert mod._parameters[n] is p, "the Parameter object stays (model.parameters() sees the pack)"
        off += -(-t.nbytes // ALIGN) * ALIGN
    assert off == len(flat)
    torch.testing.assert_close(m.projection(x), ref, rtol=0, atol=0)
    # the same model again: nothing moves (graphs captured on the first pack keep reading valid memory)
    assert pack(depth_weights(m), torch.device("cpu"), flat) is flat
    # a pack that no longer matches (a weight replaced) is made anew
    lin = m.decoder.layers[0].self_attn.o_proj
    if weights == "bf16":
        lin.weight.data = lin.weight.data.clone()
        again = pack(depth_weights(m), torch.device("cpu"), flat)
        assert again is not flat and lin.weight.data_ptr() == again.data_ptr()


def test_window_bytes_follows_the_knob_and_the_device_caps():
    mb = 2**20
    assert window_bytes("max", 30 * mb, 128 * mb, 200 * mb) == 30 * mb
    assert window_bytes("MAX", 30 * mb, 20 * mb, 200 * mb) == 20 * mb
    assert window_bytes("16", 30 * mb, 128 * mb, 200 * mb) == 16 * mb
    assert window_bytes("64", 30 * mb, 128 * mb, 200 * mb) == 30 * mb
    assert window_bytes("max", 30 * mb, 128 * mb, 5 * mb) == 5 * mb
    assert window_bytes("0.5", 30 * mb, 128 * mb, 200 * mb) == mb // 2
    assert window_bytes("0", 30 * mb, 128 * mb, 200 * mb) == 0


def test_off_on_the_cpu_and_at_zero(monkeypatch):
    m = tiny_model()
    assert L2Residency.for_model(m, "max") is None
    monkeypatch.setenv("CSMSERVE_L2_RESIDENT_MB", "0")
    assert L2Residency.for_model(m) is None
    assert not hasattr(m, "l2_pack"), "nothing packed where it is off"
