"""csmserve: a streaming inference server for Sesame's CSM-1B and the Mimi codec.

`from csmserve import CSM, Segment, SamplingParams`; resolved lazily so that importing a
submodule (e.g. the CPU-only scheduler) does not load the model code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["CSM", "GenerationResult", "Segment", "SamplingParams"]

if TYPE_CHECKING:
    from csmserve.api import CSM, GenerationResult, Segment
    from csmserve.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("CSM", "GenerationResult", "Segment"):
        from csmserve import api

        return getattr(api, name)
    if name == "SamplingParams":
        from csmserve.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'csmserve' has no attribute {name!r}")
