"""engine/outputs.py's Router: one EngineStep's rows -> each stream's chunks, first frames first."""
from __future__ import annotations

import numpy as np

from csmserve.engine.outputs import EngineStep, Router


def _step(handles, frame_start, final=None) -> EngineStep:
    n = len(handles)
    z = np.zeros(n, np.int64)
    return EngineStep(1, 0, np.arange(n), np.asarray(handles, np.int64), np.asarray(frame_start, np.int64), z,
                      np.ones(n, bool), np.zeros(n, np.uint8), np.zeros(n, bool) if final is None else final)


def test_rows_with_a_request_s_first_frame_are_delivered_before_the_others():
    K, fs = 4, 8
    router = Router(K, first_chunk_frames=1, chunk_frames=1)
    got: list[tuple[str, int]] = []
    for h in (1, 2, 3, 4):
        router.open(h, f"r{h}", lambda c, h=h: got.append((c.request_id, c.frame_start)))
    codes = np.arange(4 * K).reshape(4, K)
    pcm = np.zeros((4, fs), np.float32)
    # rows 0 and 2 continue their streams (frames 7, 3); rows 1 and 3 are new requests' first frames
    router.deliver(_step([1, 2, 3, 4], [7, 0, 3, 0]), codes, pcm)
    assert [r for r, _ in got] == ["r2", "r4", "r1", "r3"]
    # each stream still gets its own row's codes
    got.clear()
    seen = {}
    for h in (1, 2, 3, 4):
        router.streams[h].sink = lambda c, h=h: seen.__setitem__(h, c.codes.copy())
    router.deliver(_step([1, 2, 3, 4], [8, 1, 4, 1]), codes, pcm)
    assert all(np.array_equal(seen[h], codes[i:i + 1]) for i, h in enumerate((1, 2, 3, 4)))
