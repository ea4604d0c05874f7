"""engine/trace.py: a Tracer's tables, request records and GC pauses land as JSON lines in its file."""
from __future__ import annotations

import gc
import json

from csmserve.engine import trace


def test_tracer_writes_tables_requests_and_gc(tmp_path):
    t = trace.Tracer(str(tmp_path), "engine")
    try:
        t.row("step", 1, 0.0, 0.1, 0.2, 0.3, 0.4, 8, 1, 12, 1, 0.0)
        t.request({"id": "r1", "drained": 0.2, "dstep": 1})
        t.stamp("r2", received=1.0)
        t.stamp("r2", written=2.0)
        gc.collect()
        t.flush()
    finally:
        t.close()
    lines = [json.loads(x) for x in t.path.read_text().splitlines()]
    assert lines[0]["k"] == "meta" and lines[0]["role"] == "engine"
    by = {}
    for rec in lines[1:]:
        by.setdefault(rec["k"], []).append(rec)
    step = by["step"][0]
    assert step["cols"] == list(trace.TABLES["step"]) and step["rows"] == [[1, 0.0, 0.1, 0.2, 0.3, 0.4, 8, 1, 12, 1, 0.0]]
    assert [r["id"] for r in by["req"]] == ["r1"]  # r2 is pending until done()
    pauses = [row for rec in by["gc"] for row in rec["rows"]]
    assert any(gen == 2 and t1 >= t0 for t0, t1, gen in pauses), pauses
    assert t._gc not in gc.callbacks  # closed: no callback left behind


def test_done_writes_a_pending_request_once(tmp_path):
    t = trace.Tracer(str(tmp_path), "worker", client=3)
    t.stamp("r", received=1.0, sent=1.5)
    t.done("r", written=2.0)
    t.done("r", end="eos")  # already written: nothing
    t.close()
    reqs = [json.loads(x) for x in t.path.read_text().splitlines() if '"req"' in x]
    assert reqs == [{"k": "req", "id": "r", "received": 1.0, "sent": 1.5, "written": 2.0}]
