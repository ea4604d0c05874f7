import os

import pytest

from chromium import missing


@pytest.fixture(scope="session", autouse=True)
def _chromium():
    """Every browser test needs Chromium and Playwright: skipped, saying which is missing, where one is;
    under CI=true a failure instead (CI must run them all). Session-scoped: checked before any module's server."""
    why = missing()
    if why:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
