"""Launch configurations of the kernels on CSM-1B's shapes: measured on one H200 by bench/kernel_sweep.py.

CSMSERVE_KERNEL_TUNING picks them, read once at import:
- unset: the tables below (the H200's);
- "off": none (each kernel's own rule: gemv.blocks() with 4 warps, sampler ARITY 2, 4 warps);
- a path: a JSON file as bench/kernel_sweep.py writes it ({"gemv": [[m, n, k, glu, norm, BLOCK_N, BLOCK_K,
  warps, stages], ...], "sampler": {"arity": a, "warps": w}, "depth_attention": {"warps": w}}), for another GPU.
"""
from __future__ import annotations

import json
import os

# (m, n, k, glu, norm) -> (BLOCK_N, BLOCK_K, num_warps, num_stages)
H200_GEMV: dict[tuple[int, int, int, bool, bool], tuple[int, int, int, int]] = {}
H200_SAMPLER = {"arity": 4, "warps": 4}
H200_DEPTH_ATTENTION = {"warps": 4}
OFF_SAMPLER = {"arity": 2, "warps": 4}
OFF_DEPTH_ATTENTION = {"warps": 4}


def _load() -> tuple[dict, dict, dict]:
    src = os.environ.get("CSMSERVE_KERNEL_TUNING", "")
    if not src:
        return dict(H200_GEMV), dict(H200_SAMPLER), dict(H200_DEPTH_ATTENTION)
    if src == "off":
        return {}, dict(OFF_SAMPLER), dict(OFF_DEPTH_ATTENTION)
    with open(src) as f:
        doc = json.load(f)
    gemv = {(int(m), int(n), int(k), bool(glu), bool(norm)): (int(bn), int(bk), int(w), int(st))
            for m, n, k, glu, norm, bn, bk, w, st in doc.get("gemv", [])}
    return gemv, {**OFF_SAMPLER, **doc.get("sampler", {})}, {**OFF_DEPTH_ATTENTION, **doc.get("depth_attention", {})}


GEMV, SAMPLER, DEPTH_ATTENTION = _load()
