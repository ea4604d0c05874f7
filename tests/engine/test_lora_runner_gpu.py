"""GPU (`pytest -m gpu`): the runner's frame step and prefill with LoRA rows (a batch mixing adapters and the base)
graphed == eager, every bucket, greedy and sampled; with no adapter rows the codes are the base's."""
import numpy as np
import pytest
import torch

from csmserve.engine.request import Admission, PrefillChunk
from csmserve.engine.runner import ModelRunner
from csmserve.models.lora import random_adapter

from test_runner_gpu import prompts, tiny_model  # same folder

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def runner(model, graphs: bool) -> ModelRunner:
    r = ModelRunner(model, num_slots=16, max_seq_len=128, use_graphs=graphs, max_loras=4, max_lora_rank=16)
    for slot, rank in enumerate([16, 4, 8, 16]):
        r.load_loras([(slot, _Adapter(random_adapter(model.cfg, rank, seed=slot, std=0.05).pin()))])
    torch.cuda.synchronize()
    assert len(r.lora_loads_done()) == 4
    return r


class _Adapter:  # engine/adapters.py's Adapter, as far as the runner reads it
    def __init__(self, weights):
        self.weights = weights


def run(r, ps, seeds, adapters, temperature, steps):
    for slot, ((tok, mask), a) in enumerate(zip(ps, adapters)):
        P = len(tok)
        r.prefill([PrefillChunk(slot, 0, tok[: P - 1], mask[: P - 1], adapter=a)])
        r.admit([Admission(slot, tok[-1], mask[-1], P - 1, temperature, 20, 1.0, seeds[slot], adapter=a)])
    out = []
    for _ in range(steps):
        out.append(r.step(list(range(len(ps)))).wait()[0].copy())
    return np.stack(out, 1)  # [slots, steps, K]


@cuda
@pytest.mark.parametrize("n", [1, 2, 3, 9, 16])
def test_lora_graphs_equal_eager_with_mixed_adapters(n):
    model = tiny_model(torch.bfloat16)
    ps, seeds = prompts(n), list(range(300, 300 + n))
    adapters = [i % 5 - 1 for i in range(n)]  # -1 (the base), 0..3
    graphed, eager = runner(model, True), runner(model, False)
    for temperature in (0.0, 0.9):
        a = run(graphed, ps, seeds, adapters, temperature, 10)
        b = run(eager, ps, seeds, adapters, temperature, 10)
        np.testing.assert_array_equal(a, b)
    if n >= 2:  # the adapters change the codes
        base = run(graphed, ps, seeds, [-1] * n, 0.0, 10)
        assert not np.array_equal(base, run(graphed, ps, seeds, adapters, 0.0, 10))


@cuda
def test_a_pool_with_no_adapter_rows_gives_the_base_codes():
    model = tiny_model(torch.bfloat16)
    ps, seeds = prompts(4), [1, 2, 3, 4]
    plain = ModelRunner(model, num_slots=16, max_seq_len=128, use_graphs=True)
    np.testing.assert_array_equal(run(runner(model, True), ps, seeds, [-1] * 4, 0.0, 10),
                                  run(plain, ps, seeds, [-1] * 4, 0.0, 10))


class _Spy:  # a captured graph whose replays are recorded as (kind, lora)
    def __init__(self, graph, kind: str, lora: bool, seen: list) -> None:
        self.graph, self.key, self.seen = graph, (kind, lora), seen

    def replay(self) -> None:
        self.seen.append(self.key)
        self.graph.replay()


@cuda
def test_the_plain_graphs_replay_while_no_row_has_an_adapter():
    """A runner with a pool captures each bucket with the LoRA kernels and without: steps and prefills whose rows are
    all on the base replay the plain graphs (the base's codes); one adapter row switches its step to the LoRA graphs."""
    model = tiny_model(torch.bfloat16)
    r = runner(model, True)
    seen: list = []
    for kind, table in (("step", r.graphs.graphs), ("prefill", r.prefill_graphs.graphs)):
        assert {lora for _, lora in table} == {False, True}
        for key, g in list(table.items()):
            table[key] = _Spy(g, kind, key[1], seen)
    ps, seeds = prompts(3), [1, 2, 3]
    base = run(r, ps, seeds, [-1] * 3, 0.0, 6)
    assert set(seen) == {("step", False), ("prefill", False)}
    seen.clear()
    mixed = run(r, ps, seeds, [-1, 2, -1], 0.0, 6)
    assert [k for k in seen if k[0] == "prefill"] == [("prefill", False), ("prefill", True), ("prefill", False)]
    assert [k for k in seen if k[0] == "step"] == [("step", True)] * 6
    np.testing.assert_array_equal(mixed[[0, 2]], base[[0, 2]])  # the base rows' codes, whatever graph ran them
    assert not np.array_equal(mixed[1], base[1])


@cuda
def test_a_lone_adapter_merged_replays_the_plain_graphs_and_restores_the_base_bits():
    """Every row on one adapter: after MERGE_AFTER steps the plain graphs replay on merged weights (graphed == eager,
    and the codes close to the LoRA kernels' run: bf16 rounds the merge once); a base row puts the base bits back."""
    from csmserve.engine.runner import MERGE_AFTER

    model = tiny_model(torch.bfloat16)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    ps, seeds = prompts(3), [1, 2, 3]
    steps = MERGE_AFTER + 6
    kernels = ModelRunner(model, num_slots=16, max_seq_len=128, use_graphs=True, max_loras=4, max_lora_rank=16,
                          lora_merge=False)
    for slot, rank in enumerate([16, 4, 8, 16]):
        kernels.load_loras([(slot, _Adapter(random_adapter(model.cfg, rank, seed=slot, std=0.05).pin()))])
    torch.cuda.synchronize()
    kernels.lora_loads_done()
    want = run(kernels, ps, seeds, [2] * 3, 0.0, steps)
    del kernels
    eager = run(runner(model, False), ps, seeds, [2] * 3, 0.0, steps)
    r = runner(model, True)
    seen: list = []
    for key, g in list(r.graphs.graphs.items()):
        r.graphs.graphs[key] = _Spy(g, "step", key[1], seen)
    got = run(r, ps, seeds, [2] * 3, 0.0, steps)
    assert [lora for _, lora in seen] == [True] * (MERGE_AFTER - 1) + [False] * (steps - MERGE_AFTER + 1)
    assert r.merge.slot == 2
    np.testing.assert_array_equal(got, eager)
    np.testing.assert_array_equal(got[:, :MERGE_AFTER - 1], want[:, :MERGE_AFTER - 1])  # before the merge: the same
    # the first merged frame's codebook 0 (no depth step before it to diverge in): bf16's other rounding, same codes
    np.testing.assert_array_equal(got[:, MERGE_AFTER - 1, 0], want[:, MERGE_AFTER - 1, 0])
    print("merged against the LoRA kernels, codes equal after the merge:", (got == want)[:, MERGE_AFTER - 1:].mean())
    run(r, ps[:1], seeds, [-1], 0.0, 1)  # a base row: the base weights back, bit for bit
    assert r.merge.slot == -1
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())
