"""The README's commands are what CI runs (.ci/run), and its test command (scripts/test.sh) runs every stage
whatever an earlier one gave, says which failed, and sets up or skips what the tests need."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> dict[str, str]:
    """Each README section's first bash block's first line: {"Set up and speak": ..., "Run the tests": ...}."""
    out, section = {}, None
    lines = (ROOT / "README.md").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:].split(" (")[0]
        elif line == "```bash" and section not in out:
            out[section] = lines[i + 1]
    return out


def test_ci_runs_exactly_the_readme_commands():
    readme = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    ran = [shlex.split(line)[2] for line in ci.splitlines() if line.startswith("bash -ec ")]
    assert ran == [readme["Set up and speak"], readme["Run the tests"]]
    code = [line for line in ci.splitlines() if line.strip() and not line.startswith(("#", "bash -ec "))]
    # nothing else: no apt-get or pip of its own; only the install check beside the tests, and the exit status
    assert not [line for line in code if re.search(r"apt-get|pip |pytest|sudo", line)], code
    assert any("scripts/install_check.sh" in line for line in code)


def _stub_bin(tmp_path: Path, python: str, apt: str | None = None, chromium: bool = True) -> dict:
    """A PATH of stand-ins: `python` (a shell script), optionally `apt-get` and `chromium`, and the few tools
    test.sh needs: nothing of the machine's is installed or run."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("dirname", "id", "env", "cat"):
        (bin_ / tool).symlink_to(subprocess.run(["/bin/sh", "-c", f"command -v {tool}"], capture_output=True,
                                                text=True, check=True).stdout.strip())
    scripts = {"python": python, "apt-get": apt, "chromium": "exit 0" if chromium else None}
    for name, body in scripts.items():
        if body is not None:
            (bin_ / name).write_text(f"#!/bin/sh\necho \"{name} $*\" >> {tmp_path}/calls\n{body}\n")
            (bin_ / name).chmod(0o755)
    return {"PATH": str(bin_), "HOME": str(tmp_path)}


def _test_sh(env: dict, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    r = subprocess.run(["/bin/bash", str(ROOT / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return r, calls


def _stages(out: str) -> dict[str, str]:
    table = out.split("== stages\n", 1)[1].splitlines()
    return {m.group(1).strip(): m.group(2) for m in (re.match(r"(.{26}) (\S+)", line) for line in table) if m}


def test_every_stage_runs_and_the_summary_names_the_failed_one(tmp_path):
    # the serial stage fails: the Ray stage still runs, and the exit status says a stage failed
    env = _stub_bin(tmp_path, 'case "$*" in *"serial and not gpu"*) exit 3;; esac; exit 0')
    r, calls = _test_sh(env, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    pytests = [c for c in calls if c.startswith("python -m pytest")]
    assert len(pytests) == 3 and pytests[-1].endswith("tests/ray_serve"), calls
    assert _stages(r.stdout) == {"install (pip)": "passed", "chromium (apt)": "passed",
                                 "suite (2 workers)": "passed", "serial": "FAILED", "ray_serve": "passed"}
    assert re.search(r"^serial +FAILED \(exit 3\) +\d+ s$", r.stdout, re.M), r.stdout
    assert re.search(r"\nray_serve +passed +\d+ s\n$", r.stdout), r.stdout  # the last line
    assert not [c for c in calls if c.startswith("apt-get")]  # chromium was there


def test_all_stages_pass(tmp_path):
    r, calls = _test_sh(_stub_bin(tmp_path, "exit 0"), tmp_path)
    assert r.returncode == 0 and set(_stages(r.stdout).values()) == {"passed"}, r.stdout


def test_chromium_is_installed_with_apt_as_root_or_its_tests_skip(tmp_path):
    env = _stub_bin(tmp_path, "exit 0", apt="exit 100", chromium=False)  # apt-get fails (no network, no root)
    r, calls = _test_sh(env, tmp_path)
    if os.geteuid() == 0:
        assert [c.split()[1] for c in calls if c.startswith("apt-get")] == ["update"], calls
        assert "apt-get could not install chromium: tests/browser skip" in r.stdout
    else:
        assert not [c for c in calls if c.startswith("apt-get")]
        assert "tests/browser skip" in r.stdout
    assert r.returncode == 0 and _stages(r.stdout)["chromium (apt)"] == "missing"  # the tests skip, saying why
    r, _ = _test_sh({**env, "CI": "true"}, tmp_path)
    assert r.returncode == 1 and _stages(r.stdout)["chromium (apt)"] == "FAILED"  # CI must run them


def test_browser_tests_skip_without_chromium_and_fail_in_ci(tmp_path):
    # `chromium` hidden: PATH holds only this Python's folder. Skipped with the reason, never an error
    # (test_dialogue_page.py errored here); under CI=true each fails, saying what is missing
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    args = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
            str(ROOT / "tests" / "browser")]
    n = sum(len(re.findall(r"^def test_", p.read_text(), re.M)) for p in (ROOT / "tests" / "browser").glob("test_*.py"))
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith(f"{n} skipped in"), r.stdout[-2000:]
    assert r.stdout.count("no Chromium: `chromium` is not on PATH (apt-get install -y chromium") == n
    r = subprocess.run(args, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and r.stdout.strip().splitlines()[-1].startswith(f"{n} errors in"), r.stdout[-2000:]
