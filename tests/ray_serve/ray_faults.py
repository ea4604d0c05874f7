"""The tests' replica factory (ReplicaSpec.csm_factory): the usual engine, whose frame step fails as a
lost device does once the file $CSMSERVE_TEST_FAULTS/kill-<replica> exists."""
from __future__ import annotations

import os
from pathlib import Path

from ray import serve

from csmserve.ray.replica import build_csm


def faulty_csm(spec):
    csm = build_csm(spec)
    flag = Path(os.environ["CSMSERVE_TEST_FAULTS"]) / f"kill-{serve.get_replica_context().replica_tag}"
    runner = csm.engine.runner
    step = runner.step

    def step_or_fail(*args, **kwargs):
        if flag.exists():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")
        return step(*args, **kwargs)

    runner.step = step_or_fail
    return csm
