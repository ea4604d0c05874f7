"""NVIDIA MPS for replicas that share a GPU (`--gpus-per-replica` below 1).

Without MPS each replica's engine is a CUDA context of its own, and contexts take turns on the GPU (time slices): two
steps of 1,024 rows then cost more than one of 2,048. Two half-GPU replicas carried 69% of the plain server's
requests/s at 2,048 pcm users, every stream dry (H100, `a13dbb4`); under MPS their kernels run side by side: 90.7%
(H100, `c91c6c1`) and 100% (H200, `41d9107`), none dry at 300 ms (docs/scale-out.md).

`csmserve serve --ray` on a Ray instance of its own starts a private control daemon before Ray: its own pipe and log
folders, so only processes given CUDA_MPS_PIPE_DIRECTORY join it (the GPU's compute mode and every other process are
left as they are). Every process of the instance inherits the two variables; the daemon quits at exit. A CUDA context
is made under it first: where MPS cannot run (a container without the rights, an old driver), `--mps auto` goes on
without it, with one line in the log, and `--mps on` stops with that line. On a cluster (`--ray-address`) each node
runs its own daemon before `ray start` (docs/scale-out.md).
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile

from csmserve.config import MPS_MODES

log = logging.getLogger("csmserve.ray")
CONTROL = "nvidia-cuda-mps-control"
CHECK_S = 60  # a CUDA context under the daemon: its first client starts the MPS server
_CHECK = "import torch; torch.ones(1, device='cuda').sum().item()"


class MpsError(RuntimeError):
    """MPS could not start here (one line: why)."""


def wanted(mode: str, gpu_share: float, own_instance: bool, device: str | None) -> bool:
    """Whether `serve --ray` starts a daemon: not off, replicas sharing a GPU, a Ray instance of our own (a cluster's
    nodes run theirs), not on the CPU."""
    if mode not in MPS_MODES:
        raise ValueError(f"--mps must be one of {', '.join(MPS_MODES)}, got {mode!r}")
    return mode != "off" and 0 < gpu_share < 1 and own_instance and not (device or "").startswith("cpu")


class MpsDaemon:
    """A private MPS control daemon: `start()` (then this process's environment names it, for the processes it
    starts), `stop()` (quit, the variables and folders gone)."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root or tempfile.mkdtemp(prefix="csmserve-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.root, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.root, "log")}
        self.control: str | None = None

    def start(self, check: bool = True) -> None:
        """MpsError (one line) where it cannot run; the daemon, if started, quit again and the folders gone."""
        try:
            self._start(check)
        except MpsError:
            self.stop()
            raise
        os.environ.update(self.env)
        log.info("NVIDIA MPS: a private daemon for the replicas sharing a GPU (%s)", self.root)

    def _start(self, check: bool) -> None:
        control = shutil.which(CONTROL)
        if control is None:
            raise MpsError(f"{CONTROL} is not on PATH (NVIDIA's driver utilities)")
        for d in self.env.values():
            os.makedirs(d, exist_ok=True)
        env = {**os.environ, **self.env}
        try:
            r = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
        except (subprocess.TimeoutExpired, OSError) as e:  # a daemon that hangs or cannot be run: as a failure
            if isinstance(e, subprocess.TimeoutExpired):
                self.control = control  # it may have started: stop() asks it to quit
            raise MpsError(f"{CONTROL} -d failed: {type(e).__name__}: {e}"[:300]) from None
        if r.returncode != 0:
            raise MpsError(f"{CONTROL} -d failed: {(r.stderr or r.stdout).strip()[:200]}")
        self.control = control
        if not check:
            return
        try:
            c = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True,
                               timeout=CHECK_S)
        except (subprocess.TimeoutExpired, OSError):
            raise MpsError(f"a CUDA context under MPS failed: none in {CHECK_S} s") from None
        if c.returncode != 0:
            why = (c.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise MpsError(f"a CUDA context under MPS failed: {why}")

    def stop(self) -> None:
        if self.control is not None:
            try:
                subprocess.run([self.control], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                               text=True, timeout=30)
            except (subprocess.TimeoutExpired, OSError) as e:
                log.warning("NVIDIA MPS: the daemon did not quit (%s)", type(e).__name__)
            self.control = None
        for key, value in self.env.items():
            if os.environ.get(key) == value:
                del os.environ[key]
        shutil.rmtree(self.root, ignore_errors=True)


def start_for(mode: str, gpu_share: float, own_instance: bool, device: str | None) -> MpsDaemon | None:
    """The daemon `serve --ray` runs, started (None: not wanted, or auto and MPS cannot run here: one log line)."""
    if not wanted(mode, gpu_share, own_instance, device):
        return None
    daemon = MpsDaemon()
    try:
        daemon.start()
    except MpsError as e:
        if mode == "on":
            raise
        log.warning("NVIDIA MPS not used (--mps auto): %s; replicas sharing a GPU take turns on it", e)
        return None
    return daemon
