"""engine/slots.py's DepthKV: which steps' positions count as static (read before the fused attention's PDL wait)."""
import torch

from csmserve.engine.slots import DepthKV
from csmserve.models.csm import CSMConfig
from csmserve.models.llama import LlamaConfig


def _kv(static_pos):
    dd = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128, max_seq_len=33)
    return DepthKV(CSMConfig(decoder=dd, num_codebooks=8), 2, torch.float32, torch.device("cpu"),
                   static_pos=static_pos)


def test_only_views_of_the_static_positions_are_static():
    static = torch.arange(8)
    kv = _kv(static)
    kv.begin(static[3:4].expand(2, 1))  # CSMModel.decode_frame's positions: views of the runner's depth_pos
    assert kv.pos_static
    kv.begin(static[:2].expand(2, 2))
    assert kv.pos_static
    kv.begin(static[3:4].expand(2, 1) + 0)  # computed in the graph: not static
    assert not kv.pos_static
    kv.begin(torch.arange(8)[3:4].expand(2, 1))  # an equal tensor that is not the table
    assert not kv.pos_static
    kv = _kv(None)  # no table given: never static
    kv.begin(static[3:4].expand(2, 1))
    assert not kv.pos_static
