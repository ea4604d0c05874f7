"""Native audio libraries by name: the copy PyAV's wheel bundles (av.libs/), else the system's.

    lib = native("mp3lame")   # ctypes.CDLL, or None where neither exists

PyAV's manylinux wheels carry libmp3lame and libopus beside libav; calling them directly (audio/lame.py,
audio/opus.py) skips PyAV's frames, re-blocking filter graph, packets and muxer for the two formats
that cost the API workers most. ctypes.CDLL releases the GIL for every call.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from functools import cache


def bundled(name: str) -> list[str]:
    """Paths of lib{name}* shipped with PyAV (its wheel's av.libs/, or inside the package)."""
    try:
        import av
    except ImportError:
        return []
    base = os.path.dirname(av.__file__)
    return sorted(glob.glob(os.path.join(base, os.pardir, "av.libs", f"lib{name}*"))
                  or glob.glob(os.path.join(base, "**", f"lib{name}*"), recursive=True))


@cache
def native(name: str) -> ctypes.CDLL | None:
    """lib{name} loaded once per process, or None."""
    for path in bundled(name) + [p for p in [ctypes.util.find_library(name)] if p]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
