"""csmserve/ray/mps.py: when `serve --ray` starts a private MPS daemon, its start and stop (a stand-in control binary
on PATH records what it is asked), and what auto / on do where MPS cannot run. No GPU, no Ray."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from csmserve.ray import mps


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("mode, share, own, device, want", [
    ("auto", 0.5, True, None, True), ("on", 0.25, True, "cuda", True), ("off", 0.5, True, None, False),
    ("auto", 1.0, True, None, False), ("auto", 0.0, True, "cpu", False), ("auto", 0.5, False, None, False),
    ("auto", 0.5, True, "cpu", False)])
def test_wanted_only_for_a_shared_gpu_of_an_own_instance(mode, share, own, device, want):
    assert mps.wanted(mode, share, own, device) is want


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="auto, on, off"):
        mps.wanted("yes", 0.5, True, None)
    from csmserve.config import RayConfig

    with pytest.raises(ValueError, match="RayConfig.mps"):
        RayConfig(mps="yes")


@pytest.fixture
def control(tmp_path, monkeypatch):
    """A stand-in nvidia-cuda-mps-control on PATH: appends its arguments, stdin and pipe folder to calls.txt; exits
    with $FAKE_MPS_RC."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    script = bin_dir / mps.CONTROL
    script.write_text(f"""#!/bin/sh
if [ "$1" = "-d" ]; then echo "daemon $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; else read line; echo "$line" >> {calls}; fi
exit ${{FAKE_MPS_RC:-0}}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        monkeypatch.delenv(key, raising=False)
    return calls


def test_start_names_the_daemon_for_child_processes_and_stop_quits_it(control):
    d = mps.MpsDaemon()
    d.start(check=False)
    pipe = d.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe and Path(pipe).is_dir()
    assert control.read_text().splitlines() == [f"daemon {pipe}"]  # started with its own pipe folder
    d.stop()
    assert control.read_text().splitlines()[-1] == "quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not Path(d.root).exists()


def test_no_control_binary_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(mps.MpsError, match="not on PATH"):
        mps.MpsDaemon().start()


def test_a_daemon_that_fails_to_start_is_one_line(control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_RC", "1")
    with pytest.raises(mps.MpsError, match="-d failed"):
        mps.MpsDaemon().start(check=False)


@pytest.mark.skipif(_cuda(), reason="a CUDA context runs here, stand-in daemon or not")
def test_auto_goes_on_without_mps_where_no_cuda_context_runs_under_it(control, caplog):
    """The check (a CUDA context under the daemon) fails on this CPU machine: auto logs why and returns None, the
    daemon quit and the environment as it was; on raises."""
    with caplog.at_level("WARNING", logger="csmserve.ray"):
        assert mps.start_for("auto", 0.5, True, None) is None
    assert "MPS not used" in caplog.text and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert control.read_text().splitlines()[-1] == "quit"
    with pytest.raises(mps.MpsError, match="CUDA context under MPS failed"):
        mps.start_for("on", 0.5, True, None)
    assert mps.start_for("off", 0.5, True, None) is None


def test_a_failed_start_leaves_no_folder(control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_RC", "1")
    d = mps.MpsDaemon()
    with pytest.raises(mps.MpsError):
        d.start(check=False)
    assert not Path(d.root).exists() and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_a_daemon_that_hangs_at_start_falls_back_under_auto_and_leaves_nothing(control, monkeypatch):
    """`nvidia-cuda-mps-control -d` that does not return: --mps auto goes on without MPS (one line), asks the
    daemon to quit and leaves no folder; --mps on is an MpsError."""
    run = subprocess.run

    def hangs_at_start(cmd, **kw):
        if cmd[1:] == ["-d"]:
            raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
        return run(cmd, **kw)

    monkeypatch.setattr(mps.subprocess, "run", hangs_at_start)
    roots = []
    mkdtemp = mps.tempfile.mkdtemp
    monkeypatch.setattr(mps.tempfile, "mkdtemp", lambda **k: roots.append(mkdtemp(**k)) or roots[-1])
    assert mps.start_for("auto", 0.5, True, None) is None
    assert roots and not Path(roots[0]).exists() and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    with pytest.raises(mps.MpsError, match="TimeoutExpired"):
        mps.start_for("on", 0.5, True, None)
