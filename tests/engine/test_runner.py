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


def test_a_lone_adapter_runs_merged_with_the_codes_of_the_lora_kernels(monkeypatch):
    """Every row on one adapter for MERGE_AFTER steps: the adapter goes into the weights and the plain step runs, with
    the codes of a runner that never merges (float32); a base row's prefill puts the base weights back, bit for bit;
    a copy into the merged adapter's slot does too."""
    from csmserve.engine.runner import MERGE_AFTER

    model = load_csm("dummy-tiny", dtype=torch.float32)[0]
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    W = model.cfg.frame_width
    tok, mask = np.zeros((3, W), np.int64), np.zeros((3, W), bool)
    mask[:, -1] = True
    adapter = _Adapter(random_adapter(model.cfg, 4, seed=3, std=0.2, dtype=torch.float32))

    def start(r, slot: int, a: int) -> None:
        r.prefill([PrefillChunk(slot, 0, tok[:2], mask[:2], adapter=a)])
        r.admit([Admission(slot, tok[2], mask[2], 2, 0.0, 1, 1.0, slot, adapter=a)])

    def run(merge: bool) -> tuple[ModelRunner, np.ndarray, list]:
        r = ModelRunner(model, num_slots=4, max_seq_len=64, max_loras=2, max_lora_rank=4, lora_merge=merge)
        r.load_loras([(1, adapter)])
        assert len(r.lora_loads_done()) == 1
        seen: list = []
        step = r.frame_step
        monkeypatch.setattr(r, "frame_step", lambda *a, lora, **kw: seen.append(lora) or step(*a, lora=lora, **kw))
        start(r, 0, 1)
        start(r, 2, 1)
        codes = np.stack([r.step([0, 2]).wait()[0].copy() for _ in range(MERGE_AFTER + 4)])
        return r, codes, seen

    plain, want, seen = run(False)
    assert plain.merge is None and seen == [True] * (MERGE_AFTER + 4)
    r, got, seen = run(True)
    assert seen == [True] * (MERGE_AFTER - 1) + [False] * 5 and r.merge.slot == 1
    np.testing.assert_array_equal(got, want)
    assert any(not torch.equal(p, base[n]) for n, p in model.named_parameters())  # merged: the weights moved
    start(r, 3, -1)  # a base row: its prefill gets the base weights back
    assert r.merge.slot == -1
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())
    r.step([0, 2, 3]).wait()
    assert seen[-1] is True  # a mixed step: the LoRA kernels
    for _ in range(MERGE_AFTER):
        r.step([0, 2]).wait()
    assert r.merge.slot == 1
    r.load_loras([(1, adapter)])  # another copy into the merged slot: the base weights first
    assert r.merge.slot == -1 and all(torch.equal(p, base[n]) for n, p in model.named_parameters())
    for _ in range(MERGE_AFTER):
        r.step([0, 2]).wait()
    ModelRunner(model, num_slots=4, max_seq_len=64)  # a later runner on the model: the base weights back
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())


def test_slots_are_sized_beside_the_pool_and_the_merge_copy(monkeypatch):
    """build_engine's slot count leaves room for the LoRA pool and, with lora_merge and bf16 weights, the base copy of
    every LoRA'd weight (LoraMerge's)."""
    from csmserve.config import EngineConfig
    from csmserve.engine import engine as eng, slots
    from csmserve.models.lora import LoraLayout

    model = load_csm("dummy-tiny", dtype=torch.float32)[0]
    seen = []

    def size_slots(model, mimi, max_seq_len, reserve_bytes=0, **kw):
        seen.append(reserve_bytes)
        raise RuntimeError("stop")

    monkeypatch.setattr(slots, "size_slots", size_slots)
    layout = LoraLayout(model.cfg)
    pool = 2 * 4 * layout.width * 4
    copy = sum(t.n * t.k for t in layout.targets) * 4
    for merge, weights, want in ((True, "bf16", pool + copy), (False, "bf16", pool), (True, "fp8", pool)):
        cfg = EngineConfig(max_slots=None, max_loras=2, max_lora_rank=4, prefix_cache_bytes=0, lora_merge=merge,
                           weights=weights)
        try:
            eng.build_engine(model, None, cfg)
        except RuntimeError:
            pass
        assert seen[-1] == want, (merge, weights)
