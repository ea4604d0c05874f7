"""Optional pieces behind pip extras: a missing one is one line naming the extra that installs it.

    ray = require("ray", "ray", "Ray Serve deployment")   # -> the module, or MissingExtraError:
    # "Ray Serve deployment needs the 'ray' package: pip install 'csmserve[ray]'"
"""
from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names `pip install 'csmserve[extra]'`."""


def require(module: str, extra: str, purpose: str, package: str | None = None) -> ModuleType:
    """Import `module`, or raise MissingExtraError saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports failed: that error says more
        raise MissingExtraError(f"{purpose} needs the {package or module.split('.')[0]!r} package: "
                                f"pip install 'csmserve[{extra}]'") from None
