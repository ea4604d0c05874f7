"""The tests' replica factory (ReplicaSpec.csm_factory): the usual engine, failing once the file
$CSMSERVE_TEST_FAULTS/kill-<replica> exists: in process mode (the default) the replica's engine process
is killed (SIGKILL, as the OOM killer or a crashed driver would); in thread mode the frame step fails as
a lost device does."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from ray import serve

from csmserve.ray.replica import build_engine


def faulty_csm(spec):
    engine = build_engine(spec)
    flag = Path(os.environ["CSMSERVE_TEST_FAULTS"]) / f"kill-{serve.get_replica_context().replica_tag}"
    if engine.process is not None:
        pid = engine.pid

        def kill_when_flagged() -> None:
            while not flag.exists():
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill_when_flagged, name="test-fault", daemon=True).start()
        return engine
    runner = engine.csm.engine.runner
    step = runner.step

    def step_or_fail(*args, **kwargs):
        if flag.exists():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected by the test)")
        return step(*args, **kwargs)

    runner.step = step_or_fail
    return engine
