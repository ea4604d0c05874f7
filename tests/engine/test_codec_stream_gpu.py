"""GPU: Mimi's decode on its own stream beside the next frame's generation (EngineConfig.codec_stream,
engine/graphs.py) gives the same codes and the same audio as the one-graph frame step, with rows that end and
are taken again by a new stream (its codec row reset on the codec stream) while the steps run back to back."""
import numpy as np
import pytest
import torch

from csmserve.engine.request import Admission, PrefillChunk
from csmserve.engine.runner import ModelRunner
from csmserve.models.mimi import Mimi
from csmserve.models.mimi_config import MimiConfig
from csmserve.models.mimi_loader import dummy_init

from tests.engine.test_runner_gpu import prompts, tiny_model

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_mimi(dtype):
    return dummy_init(Mimi(MimiConfig(num_hidden_layers=2, num_quantizers=8))).to("cuda", dtype).eval()


def admit(runner, slot, prompt, seed):
    tok, mask = prompt
    P = len(tok)
    runner.prefill([PrefillChunk(slot, 0, tok[: P - 1], mask[: P - 1])])
    runner.admit([Admission(slot, tok[-1], mask[-1], P - 1, 0.9, 20, 1.0, seed)])


def script(runner, steps=24):
    """Four streams; every 5th step one ends and a new one takes its slot. Steps are launched before the
    previous one is read (as the engine does), so the decode of a slot's last frame is still in flight when
    the slot is admitted again."""
    ps = prompts(12, rng=np.random.default_rng(0))
    for s in range(4):
        admit(runner, s, ps[s], 100 + s)
    codes, pcm, prev, nxt = [], [], None, 4
    for t in range(steps):
        if t and t % 5 == 0:
            admit(runner, t % 4, ps[nxt % len(ps)], 200 + t)  # its old stream's last decode may still run
            nxt += 1
        out = runner.step(np.arange(4))
        if prev is not None:
            c, p = prev.wait()
            codes.append(c.copy())
            pcm.append(p.copy())
        prev = out
    c, p = prev.wait()
    codes.append(c.copy())
    pcm.append(p.copy())
    return np.stack(codes), np.stack(pcm)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_stream_equals_one_graph_and_eager(dtype):
    model, mimi = tiny_model(dtype), tiny_mimi(dtype)
    runs = {}
    for name, kw in (("stream", dict(use_graphs=True, codec_stream=True)),
                     ("one graph", dict(use_graphs=True, codec_stream=False)),
                     ("eager", dict(use_graphs=False))):
        runner = ModelRunner(model, num_slots=8, max_seq_len=128, mimi=mimi, **kw)
        assert (runner.codec_stream is not None) == (name == "stream")
        runs[name] = script(runner)
    codes, pcm = runs["stream"]
    assert np.abs(pcm).max() > 0
    np.testing.assert_array_equal(runs["one graph"][0], runs["eager"][0])
    np.testing.assert_array_equal(codes, runs["eager"][0])
    np.testing.assert_array_equal(pcm, runs["one graph"][1])  # the same kernels on the same inputs
    np.testing.assert_allclose(pcm, runs["eager"][1], atol=1e-3 if dtype == torch.bfloat16 else 1e-5)


@cuda
def test_codec_stream_step_output_times_the_decode_behind_the_generation():
    runner = ModelRunner(tiny_model(torch.float32), num_slots=8, max_seq_len=128, mimi=tiny_mimi(torch.float32))
    admit(runner, 0, prompts(1)[0], 1)
    out = runner.step(np.arange(1))
    out.wait()
    lag = out.codec_lag_s()
    assert out.gen_event is not None and 0.0 < lag < 1.0
