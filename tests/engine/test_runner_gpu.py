"""GPU: the graphed frame step and prefill against eager (run with `pytest -m gpu`; the kernels: tests/kernels)."""
import numpy as np
import pytest
import torch

from csmserve.engine.request import Admission, PrefillChunk
from csmserve.engine.runner import ModelRunner
from csmserve.models.csm import CSMConfig, CSMModel
from csmserve.models.llama import LlamaConfig

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_model(dtype, device="cuda"):
    torch.manual_seed(0)
    bb = LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=256)
    dd = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128, max_seq_len=33)
    m = CSMModel(CSMConfig(backbone=bb, decoder=dd, text_vocab_size=300, audio_vocab_size=64, num_codebooks=8))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m.to(device, dtype).eval()


def run(runner, prompts, seeds, temperature, steps):
    for slot, (tok, mask) in enumerate(prompts):
        P = len(tok)
        runner.prefill([PrefillChunk(slot, 0, tok[: P - 1], mask[: P - 1])])
        runner.admit([Admission(slot, tok[-1], mask[-1], P - 1, temperature, 20, 1.0, seeds[slot])])
    out = []
    for _ in range(steps):
        out.append(runner.step(list(range(len(prompts)))).wait()[0].copy())
    return np.stack(out, 1)  # [slots, steps, K]


def prompts(n, K=8, rng=np.random.default_rng(0)):
    res = []
    for i in range(n):
        P = int(rng.integers(2, 40))
        tok = np.zeros((P, K + 1), np.int64)
        tok[:, K] = rng.integers(0, 300, P)
        mask = np.zeros((P, K + 1), bool)
        mask[:, K] = True
        res.append((tok, mask))
    return res


@cuda
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_graph_replay_equals_eager_every_bucket(n):
    model = tiny_model(torch.float32)
    ps, seeds = prompts(n), list(range(100, 100 + n))
    graphed = ModelRunner(model, num_slots=8, max_seq_len=128, use_graphs=True)
    eager = ModelRunner(model, num_slots=8, max_seq_len=128, use_graphs=False)
    for temperature in (0.0, 0.9):
        a = run(graphed, ps, seeds, temperature, 12)
        b = run(eager, ps, seeds, temperature, 12)
        np.testing.assert_array_equal(a, b)


def run_from_prefill(runner, prompts, seeds, temperature, steps):
    """run()'s prompts, all admitted at once with their last frame in the prefill (head) and the first frame
    from the prefill's hidden state (from_prefill), as an idle engine does (EngineConfig.first_frame_from_prefill)."""
    runner.prefill([PrefillChunk(slot, 0, tok, mask, head=True) for slot, (tok, mask) in enumerate(prompts)])
    runner.admit([Admission(slot, tok[-1], mask[-1], len(tok) - 1, temperature, 20, 1.0, seeds[slot])
                  for slot, (tok, mask) in enumerate(prompts)])
    slots = list(range(len(prompts)))
    out = [runner.step(slots, from_prefill=True).wait()[0].copy()]
    for _ in range(steps - 1):
        out.append(runner.step(slots).wait()[0].copy())
    return np.stack(out, 1)  # [slots, steps, K]


@cuda
@pytest.mark.parametrize("n", [1, 3, 8, 9])  # 9: more rows than the first-frame graphs take (the plain step)
def test_first_frame_from_prefill_graphs_equal_eager_and_the_plain_first_step(n):
    """The first frame from the prefill's kept hidden state (no backbone pass) through its graphs == eager, and ==
    the plain path (the last prompt frame through the first frame step) in float32, greedy and sampled."""
    model = tiny_model(torch.float32)
    ps, seeds = prompts(n), list(range(200, 200 + n))
    # one graphed runner for both paths (admission resets every slot's state): one capture per test, as above
    graphed = ModelRunner(model, num_slots=9, max_seq_len=128, use_graphs=True)
    eager = ModelRunner(model, num_slots=9, max_seq_len=128, use_graphs=False)
    assert graphed.graphs.first_buckets == [1, 2, 4, 8]
    for temperature in (0.0, 0.9):
        a = run_from_prefill(graphed, ps, seeds, temperature, 10)
        b = run_from_prefill(eager, ps, seeds, temperature, 10)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, run(graphed, ps, seeds, temperature, 10))


@cuda
def test_prefill_graphs_equal_eager_prefill():
    """Many chunks packed into one graphed prefill (fresh prompts, then their continuations) write the same
    KV as the eager packed prefill of the same chunks; the token count picks the graph."""
    model = tiny_model(torch.float32)
    graphed = ModelRunner(model, num_slots=8, max_seq_len=128, use_graphs=True, max_prefill_tokens=64)
    eager = ModelRunner(model, num_slots=8, max_seq_len=128, use_graphs=False, max_prefill_tokens=64)
    rng = np.random.default_rng(3)
    ps = []
    for P in (30, 25, 12, 3, 9):
        tok, mask = np.zeros((P, 9), np.int64), np.zeros((P, 9), bool)
        tok[:, 8], mask[:, 8] = rng.integers(0, 300, P), True
        ps.append((tok, mask))
    first = [PrefillChunk(i, 0, t[:10], m[:10]) for i, (t, m) in enumerate(ps)]
    rest = [PrefillChunk(i, 10, t[10:], m[10:]) for i, (t, m) in enumerate(ps) if len(t) > 10]
    assert graphed.prefill_graphs.bucket(sum(len(c.tokens) for c in first)) == 64  # 42 tokens
    assert graphed.prefill_graphs.bucket(sum(len(c.tokens) for c in rest)) == 64  # 37 tokens
    assert graphed.prefill_graphs.bucket(5) == 16
    for r in (graphed, eager):
        r.prefill(first)
        r.prefill(rest)
    torch.cuda.synchronize()
    for i, (t, _) in enumerate(ps):
        n = len(t)
        torch.testing.assert_close(graphed.kv.k[:, i, :, :n], eager.kv.k[:, i, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.kv.v[:, i, :, :n], eager.kv.v[:, i, :, :n], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        graphed.prefill([PrefillChunk(0, 0, np.zeros((65, 9), np.int64), np.zeros((65, 9), bool))])


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                            reason="needs a Hopper GPU")


@hopper
@pytest.mark.parametrize("weights,n", [("fp8", 8), ("fp8-all", 8), ("fp8-all", 24)])
def test_fp8_frame_graphs_equal_eager(weights, n):
    """FP8 weights in the frame graphs == eager, greedy and sampled; n = 24: the frame step past WEIGHT_ONLY_ROWS, on
    the dequantized bf16 copies (models/fp8.py DENSE_ROWS)."""
    from csmserve.models import fp8
    from csmserve.models.fp8 import FP8Linear

    model = tiny_model(torch.bfloat16)
    ps, seeds = prompts(n, rng=np.random.default_rng(n)), list(range(300, 300 + n))
    graphed = ModelRunner(model, num_slots=n, max_seq_len=128, use_graphs=True, weights=weights)
    eager = ModelRunner(model, num_slots=n, max_seq_len=128, use_graphs=False, weights=weights)
    lins = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert lins and all(m.fast for m in lins)
    assert all((m.dense is not None) == (fp8.DENSE_ROWS > fp8.WEIGHT_ONLY_ROWS) for m in lins)
    for temperature in (0.0, 0.9):
        np.testing.assert_array_equal(run(graphed, ps, seeds, temperature, 8), run(eager, ps, seeds, temperature, 8))
