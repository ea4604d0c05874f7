"""`csmserve serve --trace-requests DIR` (engine/trace.py): a served request's stamps from every process
join into one timeline, every phase present and in time order (bench/trace_report.py); off, nothing."""
from __future__ import annotations

import time

import httpx
import pytest

from csmserve.apps.bench.serve import trace_report
from csmserve.engine import trace
from server_helpers import ProcServer

BODY = {"model": "sesame/csm-1b", "input": "Hello there.", "voice": "alloy", "response_format": "pcm",
        "max_audio_length_ms": 240}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    s = ProcServer(tmp, workers=1, trace_requests=str(tmp / "trace")).start()
    s.trace_dir = tmp / "trace"
    yield s
    s.stop()


def _timelines(directory, n: int, timeout: float = 10.0) -> list[dict]:
    """The joined timelines once n of them have every stamp (the files are flushed every 0.5 s)."""
    deadline = time.time() + timeout
    while True:
        ts = [t for t in trace_report.timelines(trace_report.load(directory))
              if all(s in t for s in trace_report.STAMPS)]
        if len(ts) >= n or time.time() > deadline:
            return ts
        time.sleep(0.2)


def test_served_request_has_an_ordered_timeline(traced):
    ids = []
    for _ in range(1):
        r = httpx.post(f"{traced.url}/v1/audio/speech", json=BODY, timeout=60)
        assert r.status_code == 200 and r.content
        ids.append(r.headers["x-request-id"])
    ts = {t["id"]: t for t in _timelines(traced.trace_dir, 1)}
    assert set(ids) <= set(ts), (ids, list(ts))
    for rid in ids:
        t = ts[rid]
        stamps = [t[s] for s in trace_report.STAMPS]
        assert stamps == sorted(stamps), dict(zip(trace_report.STAMPS, stamps))
        assert t["fstep"] >= t["dstep"] >= 1
    roles = sorted(p.role for p in trace_report.load(traced.trace_dir))
    assert roles == ["engine", "worker"]
    text = "\n".join(trace_report.report(traced.trace_dir))
    for label, *_ in trace_report.PHASES:
        line = next(x for x in text.splitlines() if x.strip().startswith(label))
        assert "-" not in line.split(label, 1)[1].split()[:2], line  # every phase measured (all requests)
    assert "engine steps" in text and "steps from drain to first frame step" in text


def test_off_records_nothing(serve, csm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = serve()
    r = httpx.post(f"{s.url}/v1/audio/speech", json=BODY, timeout=60)
    assert r.status_code == 200
    assert trace.current() is None and csm.client.engine.tracer is None
    assert not list(tmp_path.rglob("*.jsonl"))
