"""The directory: one small deployment every replica reports to (its address, state and Prometheus text,
every RayConfig.report_interval_s). The ingresses read it: HAProxy routes to the replicas it lists as ready,
/ready counts them, /metrics shows every replica's metrics, each sample labelled `replica`.

A replica that stops reporting (replaced, its node gone) drops out after STALE_REPORTS intervals.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

from ray import serve

STALE_REPORTS = 4


@serve.deployment(name="CSMServeDirectory", num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000, logging_config={"enable_access_log": False})
class Directory:
    def __init__(self, report_interval_s: float = 0.5) -> None:
        self.stale_s = STALE_REPORTS * report_interval_s
        self.reports: dict[str, dict] = {}

    def report(self, replica: str, state: dict) -> None:
        """state: ready (bool), fatal (str | None), host and port (its data port), metrics (Prometheus text),
        and whatever else to show (active streams, pids)."""
        self.reports[replica] = {**state, "time": time.time()}

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def snapshot(self) -> dict[str, dict]:
        """replica -> its last report, for those that reported recently."""
        cutoff = time.time() - self.stale_s
        self.reports = {r: s for r, s in self.reports.items() if s["time"] >= cutoff}
        return self.reports


def readiness(reports: Mapping[str, dict]) -> dict:
    """{"ready": k, "total": n, "replicas": {id: "ready" | "loading" | "failed: <why>"}}."""
    states = {r: ("failed: " + s["fatal"]) if s.get("fatal") else ("ready" if s.get("ready") else "loading")
              for r, s in sorted(reports.items())}
    return {"ready": sum(v == "ready" for v in states.values()), "total": len(states), "replicas": states}


def merge_metrics(texts: Mapping[str, str], label: str = "replica") -> str:
    """Prometheus texts by replica -> one text, every sample labelled `label="<replica>"` (one HELP/TYPE
    per family, as the format wants)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            # counters keep prometheus_client's `# TYPE x_total counter` (what its parser reads back)
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            _, _, lines = families.setdefault(name, (fam.type, fam.documentation, []))
            lines.extend(_sample(s.name, {**s.labels, label: replica}, s.value) for s in fam.samples)
    out = []
    for name, (kind, doc, lines) in families.items():
        out += [f"# HELP {name} {_escape_help(doc)}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {_number(value)}"


def _number(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape(v: str) -> str:
    return str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n")

