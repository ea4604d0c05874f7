"""`pip install csmserve` (no extra) gives every command; --help imports neither torch nor the server;
optional pieces name the extra that installs them. (The fresh-venv install itself: scripts/install_check.sh,
run by .ci/run.)"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from csmserve.extras import MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_module("csmserve", run_name="__main__")  # what both `csmserve` and `python -m csmserve` run
except SystemExit as e:
    assert e.code in (0, None), e.code
print(sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "fastapi", "uvicorn", "av", "starlette"}}))
"""


@pytest.mark.parametrize("argv", [["--help"], ["speak", "--help"], ["serve", "--help"], ["bench", "--help"],
                                  ["talk", "--help"]])
def test_help_imports_no_torch_or_server(argv):
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=["csmserve", *argv])], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and out.stdout.strip().splitlines()[-1] == "[]", (argv, out.stdout[-300:])


def test_the_default_install_has_the_server():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["dependencies"]}
    assert {"fastapi", "uvicorn", "python-multipart", "prometheus-client", "av", "websockets", "rich",
            "httpx"} <= deps
    extras = meta["optional-dependencies"]
    assert extras["server"] == []  # kept as an alias for old install commands
    assert {"pipecat", "livekit", "test"} <= set(extras)
    assert not any(d.startswith("torch==") for d in meta["dependencies"])  # any installed build is kept
    assert meta["scripts"]["csmserve"] == "csmserve.apps.cli.main:main"


def test_a_missing_extra_names_its_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pipecat", None)  # as if pipecat-ai were not installed
    monkeypatch.delitem(sys.modules, "csmserve.integrations.pipecat", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'csmserve\[pipecat\]'"):
        importlib.import_module("csmserve.integrations.pipecat")
    monkeypatch.setitem(sys.modules, "livekit.agents", None)
    monkeypatch.delitem(sys.modules, "csmserve.integrations.livekit", raising=False)
    with pytest.raises(MissingExtraError, match=r"'livekit-agents' package: pip install 'csmserve\[livekit\]'"):
        importlib.import_module("csmserve.integrations.livekit")
    with pytest.raises(MissingExtraError, match=r"Ray Serve needs the 'ray_not_here' package: pip install "
                                                r"'csmserve\[ray\]'"):
        require("ray_not_here", "ray", "Ray Serve")
    assert require("json", "x", "y") is sys.modules["json"]
