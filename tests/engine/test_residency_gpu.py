"""GPU: L2 residency of the depth weights (engine/residency.py): every kernel node of the frame graphs carries the
window over the pack, and the codes are those of the eager runner (the window changes where bytes are cached, no
value). Run with `pytest -m gpu`."""
import numpy as np
import pytest
import torch

from csmserve.engine.residency import PERSISTING, L2Residency, node_windows
from csmserve.engine.runner import ModelRunner
from tests.engine.test_runner_gpu import prompts, run, run_from_prefill, tiny_model

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("n", [1, 3])
def test_frame_graphs_carry_the_window_and_equal_eager(monkeypatch, n):
    monkeypatch.setenv("CSMSERVE_L2_RESIDENT_MB", "max")
    model = tiny_model(torch.float32)
    ps, seeds = prompts(n), list(range(300, 300 + n))
    graphed = ModelRunner(model, num_slots=4, max_seq_len=128, use_graphs=True)
    res = graphed.residency
    assert isinstance(res, L2Residency) and res.num_bytes == len(model.l2_pack) > 0
    eager = ModelRunner(model, num_slots=4, max_seq_len=128, use_graphs=False)
    assert eager.residency is None
    graphs = list(graphed.graphs.graphs.values()) + list(graphed.graphs.first_graphs.values())
    assert graphed.graphs.first_graphs
    for g in graphs:
        windows = node_windows(g.raw_cuda_graph())
        assert len(windows) > 10
        assert set(windows) == {(model.l2_pack.data_ptr(), res.num_bytes, 1.0, PERSISTING)}
    for temperature in (0.0, 0.9):
        np.testing.assert_array_equal(run(graphed, ps, seeds, temperature, 10), run(eager, ps, seeds, temperature, 10))
        np.testing.assert_array_equal(run_from_prefill(graphed, ps, seeds, temperature, 10),
                                      run_from_prefill(eager, ps, seeds, temperature, 10))


@cuda
def test_the_real_shape_window_is_the_devices_persisting_size(monkeypatch):
    """CSM-1B's depth decoder (random weights): the pack holds its 4 layers and the projection (~224 MB in bf16);
    "max" asks for all the device sets aside, and a size in MB for that much."""
    from csmserve.engine.residency import _ATTR_MAX_PERSISTING_L2, device_attribute
    from csmserve.models.loader import load_csm

    model = load_csm("dummy", "cuda", torch.bfloat16)[0]
    res = L2Residency.for_model(model, "max")
    cap = device_attribute(_ATTR_MAX_PERSISTING_L2, torch.device("cuda"))
    assert res.num_bytes == cap > 0
    assert 200 * 2**20 < len(model.l2_pack) < 240 * 2**20
    assert L2Residency.for_model(model, "8").num_bytes == 8 * 2**20
    assert model.decoder.layers[0].self_attn.o_proj.weight.data_ptr() == model.l2_pack.data_ptr()
