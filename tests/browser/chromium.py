"""What the browser tests need: Debian's Chromium (`chromium` on PATH; scripts/test.sh
installs it with apt where it runs as root) driven by Playwright (csmserve[test]; its own browsers are never
downloaded). tests/browser/conftest.py skips every test here when one is missing, and fails them under CI=true."""
from __future__ import annotations

import importlib.util
import shutil

CHROMIUM = shutil.which("chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]  # a fake microphone (a beep)


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if CHROMIUM is None:
        return "no Chromium: `chromium` is not on PATH (apt-get install -y chromium; scripts/test.sh does it as root)"
    if importlib.util.find_spec("playwright") is None:
        return "no Playwright (pip install 'csmserve[test]')"
    return None
