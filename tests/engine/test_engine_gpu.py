"""GPU (`pytest -m gpu`): a seeded request alone and inside a batch of 16, in bfloat16 on the real shape.

bfloat16 GEMMs tile differently at different batch sizes, so sampled codes may drift apart after a
while; the test reports the share of identical frames (to $OUT/seeded_bf16.txt when OUT is set) and
requires the first frames to agree.
"""
import os

import numpy as np
import pytest
import torch

from csmserve.config import EngineConfig
from csmserve.engine.engine import Engine, EngineClient
from csmserve.engine.request import Request, SamplingParams
from csmserve.engine.runner import ModelRunner
from csmserve.models.loader import load_csm

pytestmark = pytest.mark.gpu


def prompt(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens, mask = np.zeros((n, 33), np.int64), np.zeros((n, 33), bool)
    tokens[:, 32] = rng.integers(1, 128000, n)
    mask[:, 32] = True
    return tokens, mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_request_alone_and_in_batch_of_16_bf16():
    model = load_csm("dummy", "cuda", torch.bfloat16)[0]
    cfg = EngineConfig(max_slots=16, max_seq_len=256)
    engine = Engine(ModelRunner(model, cfg.max_slots, cfg.max_seq_len), cfg)
    client = EngineClient(engine)
    frames = 40
    params = SamplingParams(temperature=0.9, top_k=50, seed=4321, max_audio_length_ms=frames * 80)
    try:
        alone = client.run([Request(*prompt(20, 1), params=params)])[0]
        others = [Request(*prompt(10 + i, 100 + i), params=SamplingParams(max_audio_length_ms=frames * 80))
                  for i in range(15)]
        batch = client.run([Request(*prompt(20, 1), params=params)] + others)[0]
    finally:
        engine.shutdown()
    a = np.concatenate([c.codes for c in alone])
    b = np.concatenate([c.codes for c in batch])
    n = min(len(a), len(b))
    same = (a[:n] == b[:n]).all(1)
    first_diff = int(np.argmin(same)) if not same.all() else n
    report = (f"seeded bf16 request, alone vs in a batch of 16: {same.mean():.1%} of {n} frames identical, "
              f"first difference at frame {first_diff}")
    print(report)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "seeded_bf16.txt"), "w") as f:
            f.write(report + "\n")
    assert same[:3].all(), report
