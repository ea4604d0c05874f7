"""CPU: which variant of the frame step and the prefill a runner with a LoRA pool runs (the graphs themselves:
test_lora_runner_gpu.py): without the LoRA kernels while none of the rows has an adapter, with them once one has."""
import numpy as np
import torch

from csmserve.engine.request import Admission, PrefillChunk
from csmserve.engine.runner import ModelRunner
from csmserve.models.loader import load_csm
from csmserve.models.lora import random_adapter

from test_lora_runner_gpu import _Adapter  # same folder


def test_a_pool_is_read_only_by_steps_and_prefills_with_an_adapter_row(monkeypatch):
    model = load_csm("dummy-tiny", dtype=torch.float32)[0]
    r = ModelRunner(model, num_slots=4, max_seq_len=64, max_loras=2, max_lora_rank=4)
    r.load_loras([(1, _Adapter(random_adapter(model.cfg, 4, dtype=torch.float32)))])
    assert len(r.lora_loads_done()) == 1
    seen: list = []
    step, prefill = r.frame_step, r.prefill_forward
    monkeypatch.setattr(r, "frame_step",
                        lambda *a, lora, **kw: seen.append(("step", lora)) or step(*a, lora=lora, **kw))
    monkeypatch.setattr(r, "prefill_forward", lambda p, b, lora: seen.append(("prefill", lora)) or prefill(p, b, lora))
    W = model.cfg.frame_width
    tok, mask = np.zeros((3, W), np.int64), np.zeros((3, W), bool)
    mask[:, -1] = True

    def start(slot: int, adapter: int) -> None:
        r.prefill([PrefillChunk(slot, 0, tok[:2], mask[:2], adapter=adapter)])
        r.admit([Admission(slot, tok[2], mask[2], 2, 0.0, 1, 1.0, slot, adapter=adapter)])

    start(0, -1)
    start(2, -1)
    r.step([0, 2]).wait()
    assert seen == [("prefill", False), ("prefill", False), ("step", False)]
    seen.clear()
    start(3, 1)  # a row with pool slot 1's adapter
    r.step([0, 2, 3]).wait()
    r.step([0, 2]).wait()  # that row not in this step: the plain step again
    r.step([3]).wait()
    assert seen == [("prefill", True), ("step", True), ("step", False), ("step", True)]
    seen.clear()
    start(3, -1)  # the slot reused by a request without an adapter
    r.step([0, 3]).wait()
    assert seen == [("prefill", False), ("step", False)]
