"""The directory's views (csmserve/ray/directory.py): readiness counts and merged, labelled metrics."""
import pytest

pytest.importorskip("ray.serve")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from csmserve.ray.directory import merge_metrics, readiness  # noqa: E402
from csmserve.server.metrics import Metrics  # noqa: E402


def test_readiness():
    r = readiness({"a": {"ready": True}, "b": {"ready": False}, "c": {"ready": False, "fatal": "CUDA error"}})
    assert (r["ready"], r["total"]) == (1, 3)
    assert r["replicas"] == {"a": "ready", "b": "loading", "c": "failed: CUDA error"}


def test_merged_metrics_are_valid_and_labelled_by_replica():
    from csmserve.engine.outputs import EngineStats

    texts = {}
    for name, frames in (("r1", 3), ("r2", 5)):
        m = Metrics("dummy-tiny", lambda: EngineStats(running=1, prefix_hits=frames))
        m.frames.inc(frames)
        m.ttfa.observe(0.05)
        texts[name] = m.render().decode()
    merged = merge_metrics(texts)
    families = {f.name: f for f in text_string_to_metric_families(merged)}  # parses: one HELP/TYPE each
    assert merged.count("# TYPE csmserve:generated_frames_total counter") == 1
    frames = {s.labels["replica"]: s.value for s in families["csmserve:generated_frames"].samples
              if s.name.endswith("_total")}
    assert frames == {"r1": 3.0, "r2": 5.0}
    hits = {s.labels["replica"]: s.value for s in families["csmserve:prefix_cache_hits"].samples}
    assert hits == {"r1": 3.0, "r2": 5.0}
    buckets = [s for s in families["csmserve:time_to_first_audio_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["replica"] for s in buckets} == {"r1", "r2"} and all("le" in s.labels for s in buckets)
