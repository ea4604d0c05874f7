"""GPU (`pytest -m gpu`): speculation in the frame graphs (IF nodes per verify pass) == eager, every
bucket; its Triton path against its torch path; greedy == plain on the GPU; FP8 weights
(alone and with speculation) in the frame graphs == eager."""
import numpy as np
import pytest
import torch

from csmserve.engine.request import Admission, PrefillChunk
from csmserve.engine.runner import ModelRunner
from csmserve.engine.speculate import RowParams, Speculator, conditional_nodes_supported

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def model_on_gpu(dtype, agree=0.2, embed_noise=0.1, K=12, V=64):
    from test_speculate import tiny_model  # same folder: the CPU tests' tiny models

    return tiny_model(K, V, agree=agree, embed_noise=embed_noise).to("cuda", dtype)


def run(runner, n, temperature, steps, K):
    rng = np.random.default_rng(0)
    for slot in range(n):
        P = int(rng.integers(2, 30))
        tok, mask = np.zeros((P, K + 1), np.int64), np.zeros((P, K + 1), bool)
        tok[:, K], mask[:, K] = rng.integers(0, 16, P), True
        runner.prefill([PrefillChunk(slot, 0, tok[: P - 1], mask[: P - 1])])
        t = temperature if slot % 3 else 0.0  # every third row greedy
        runner.admit([Admission(slot, tok[-1], mask[-1], P - 1, t, 20, 0.95, 100 + slot)])
    out = [runner.step(list(range(n))).wait()[0].copy() for _ in range(steps)]
    return np.stack(out, 1)  # [n, steps, K]


@cuda
def test_conditional_graph_nodes_are_used():
    """Without CUDA graph IF nodes every frame would run all K-2 verify passes (exact, but never faster)."""
    if not conditional_nodes_supported():  # the environment's limit, not a failure of ours
        pytest.skip(f"torch {torch.__version__}: no CUDAGraph.begin_capture_to_if_node")
    spec = Speculator(model_on_gpu(torch.float32), 4, 8)
    assert spec.conditional and spec.use_triton


@cuda
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_spec_graph_replay_equals_eager_every_bucket(n, k):
    model = model_on_gpu(torch.float32)
    K = model.cfg.num_codebooks
    graphed = ModelRunner(model, num_slots=8, max_seq_len=64, use_graphs=True, spec_depth=k)
    eager = ModelRunner(model, num_slots=8, max_seq_len=64, use_graphs=False, spec_depth=k)
    for temperature in (0.0, 0.9):
        a = run(graphed, n, temperature, 8, K)
        b = run(eager, n, temperature, 8, K)
        np.testing.assert_array_equal(a, b)
    ga, ea = graphed.spec.snapshot().read(), eager.spec.snapshot().read()
    assert ga == ea, (ga, ea)  # the same passes, accepts and commits
    assert 0.05 < ga["acceptance"] < 0.98, ga


@cuda
def test_spec_graphs_without_if_nodes_equal_eager():
    """Buckets above Speculator.conditional_max_batch run every verify pass (no IF nodes): the same codes."""
    model = model_on_gpu(torch.float32)
    K = model.cfg.num_codebooks
    graphed = ModelRunner(model, num_slots=8, max_seq_len=64, use_graphs=False, spec_depth=3)
    graphed.spec.conditional_max_batch = 2  # buckets 1, 2 with IF nodes; 4, 8 without
    graphed.graphs = graphed.frame_graphs()
    eager = ModelRunner(model, num_slots=8, max_seq_len=64, use_graphs=False, spec_depth=3)
    for n in (1, 3, 8):
        np.testing.assert_array_equal(run(graphed, n, 0.9, 6, K), run(eager, n, 0.9, 6, K))


@cuda
def test_spec_graph_replay_equals_eager_bf16():
    model = model_on_gpu(torch.bfloat16)
    K = model.cfg.num_codebooks
    graphed = ModelRunner(model, num_slots=8, max_seq_len=64, use_graphs=True, spec_depth=4)
    eager = ModelRunner(model, num_slots=8, max_seq_len=64, use_graphs=False, spec_depth=4)
    np.testing.assert_array_equal(run(graphed, 8, 0.9, 8, K), run(eager, 8, 0.9, 8, K))


@cuda
@pytest.mark.parametrize("k", range(2, 9))
def test_spec_greedy_equals_plain_on_gpu(k):
    model = model_on_gpu(torch.float32, agree=0.05, embed_noise=0.05, V=32)  # ~50% of greedy drafts accepted
    K = model.cfg.num_codebooks
    plain = run(ModelRunner(model, num_slots=8, max_seq_len=64), 8, 0.0, 6, K)
    spec = ModelRunner(model, num_slots=8, max_seq_len=64, spec_depth=k)
    np.testing.assert_array_equal(run(spec, 8, 0.0, 6, K), plain)
    assert spec.spec.snapshot().read()["acceptance"] > 0.25


@cuda
@pytest.mark.parametrize("prm", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_spec_triton_kernels_match_torch_reference(prm):
    model = model_on_gpu(torch.float32)
    model.prepare_heads()
    B = 256
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(B, model.cfg.backbone.dim, device="cuda", generator=g)
    t = torch.full((B,), prm[0], device="cuda")
    t[::5] = 0
    params = RowParams(t, torch.full((B,), prm[1], device="cuda"), torch.full((B,), prm[2], device="cuda"),
                       torch.arange(B, device="cuda") * 31 + 7, torch.full((B,), 5, device="cuda"))
    from csmserve.models.sampler import sample_torch

    def sampler(logits, cb):  # the torch sampler on both sides: only the speculation kernels differ
        return sample_torch(logits, params.temperature, params.top_k, params.top_p, params.seed, params.frame, cb)

    out = []
    for use_triton in (True, False):
        spec = Speculator(model, 4, B)
        spec.use_triton = use_triton
        with torch.inference_mode():
            out.append((spec.decode_frame(h, sampler, params).cpu().numpy(), spec.snapshot().read()))
    (a, sa), (b, sb) = out
    greedy = (t == 0).cpu().numpy()
    np.testing.assert_array_equal(a[greedy], b[greedy])
    same_rows = (a == b).all(1).mean()
    assert same_rows >= 0.97, same_rows  # ties at a top-k/top-p cut-off and float rounding of p/q only
    assert abs(sa["acceptance"] - sb["acceptance"]) < 0.03, (sa, sb)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper GPU")


@hopper
@pytest.mark.parametrize("weights,spec_depth,n", [("fp8", None, 8), ("fp8-all", None, 8), ("fp8", 4, 8),
                                                   ("fp8-all", None, 24)])
def test_fp8_frame_graphs_equal_eager(weights, spec_depth, n):
    """n = 24: the frame step past WEIGHT_ONLY_ROWS, on the dequantized bf16 copies (models/fp8.py DENSE_ROWS)."""
    from csmserve.models import fp8
    from csmserve.models.fp8 import FP8Linear

    model = model_on_gpu(torch.bfloat16)
    graphed = ModelRunner(model, num_slots=n, max_seq_len=64, use_graphs=True, spec_depth=spec_depth, weights=weights)
    eager = ModelRunner(model, num_slots=n, max_seq_len=64, use_graphs=False, spec_depth=spec_depth, weights=weights)
    lins = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert all(m.fast for m in lins)
    assert all((m.dense is not None) == (fp8.DENSE_ROWS > fp8.WEIGHT_ONLY_ROWS) for m in lins)
    np.testing.assert_array_equal(run(graphed, n, 0.9, 8, 12), run(eager, n, 0.9, 8, 12))
