"""Launch configurations of the kernels on CSM-1B's shapes: measured on one H200 by bench/kernel_sweep.py.

CSMSERVE_KERNEL_TUNING picks them, read once at import:
- unset: the tables below (the H200's);
- "off": none (each kernel's own rule: gemv.blocks() with 4 warps; the sampler and depth attention, 4 warps);
- a path: a JSON file as bench/kernel_sweep.py writes it ({"gemv": [[m, n, k, glu, norm, BLOCK_N, BLOCK_K,
  warps, stages], ...], "gemv_fp8": [the same for e4m3 weights], "sampler": {"warps": [[rows, w], ...]},
  "depth_attention": {"warps": [[rows, w], ...]}}), for another GPU. A warps table gives w from `rows` batch rows
  up (the entry with the most rows <= the batch). bench/tuning/h100_fp8.json: the H100's e4m3 table at 1-2 rows, with
  the H200's other tables (fp8-all's frame step at batch 1 3.62 -> 3.56 ms on the H100; docs/benchmarks.md).
"""
from __future__ import annotations

import json
import os

# (m, n, k, glu, norm) -> (BLOCK_N, BLOCK_K, num_warps, num_stages)
# (the rule elsewhere: within 2% of it, or slower); GEMVs from `COMMIT=4291844 bash scripts/gpu.sh sweep`, the
# sampler's and depth attention's warps from `COMMIT=825a61c bash scripts/gpu.sh sweep` (docs/benchmarks.md)
H200_GEMV: dict[tuple[int, int, int, bool, bool], tuple[int, int, int, int]] = {
    (1, 2112, 1024, False, False): (1, 1024, 4, 4),  # depth head: 3.82 -> 3.33 us
    (1, 1024, 2048, False, False): (1, 2048, 8, 1),  # projection: 3.78 -> 3.40
    (2, 8192, 1024, True, True): (32, 128, 8, 1),  # depth gate_up + SiLU*up, 2 rows: 13.38 -> 12.36
    (2, 2112, 1024, False, False): (2, 1024, 4, 1),  # depth head, 2 rows: 4.30 -> 3.91
    (2, 1024, 2048, False, False): (1, 1024, 4, 2),  # projection, 2 rows: 3.82 -> 3.59
}
# the same keys for e4m3 weights (FP8Linear's, weight-only at 1-2 rows): `bench/kernel_sweep.py --fp8`
H200_GEMV_FP8: dict[tuple[int, int, int, bool, bool], tuple[int, int, int, int]] = {}
H200_SAMPLER = {"warps": [[1, 8], [2048, 4]]}  # 10.40 us at 1 row (4 warps: 12.80); 94.3 at 2,048 (8: 97.1)
H200_DEPTH_ATTENTION = {"warps": [[1, 4], [256, 1]]}  # 4.06 us at 1 row; 26.9 at 2,048 rows (4 warps: 45.8)
OFF_SAMPLER = {"warps": [[1, 4]]}
OFF_DEPTH_ATTENTION = {"warps": [[1, 4]]}


def by_rows(table: list[list[int]], rows: int) -> int:
    """The value of a [[rows_from, value], ...] table (ascending rows_from, the first 1) at `rows` batch rows."""
    value = table[0][1]
    for start, v in table:
        if rows >= start:
            value = v
    return value


def _gemv_table(rows: list) -> dict:
    return {(int(m), int(n), int(k), bool(glu), bool(norm)): (int(bn), int(bk), int(w), int(st))
            for m, n, k, glu, norm, bn, bk, w, st in rows}


def _load() -> tuple[dict, dict, dict, dict]:
    src = os.environ.get("CSMSERVE_KERNEL_TUNING", "")
    if not src:
        return dict(H200_GEMV), dict(H200_GEMV_FP8), dict(H200_SAMPLER), dict(H200_DEPTH_ATTENTION)
    if src == "off":
        return {}, {}, dict(OFF_SAMPLER), dict(OFF_DEPTH_ATTENTION)
    with open(src) as f:
        doc = json.load(f)
    return (_gemv_table(doc.get("gemv", [])), _gemv_table(doc.get("gemv_fp8", [])),
            {**OFF_SAMPLER, **doc.get("sampler", {})}, {**OFF_DEPTH_ATTENTION, **doc.get("depth_attention", {})})


GEMV, GEMV_FP8, SAMPLER, DEPTH_ATTENTION = _load()
