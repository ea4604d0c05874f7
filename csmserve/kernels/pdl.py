"""Programmatic dependent launch (Hopper and later) for the frame step's chain of small Triton kernels.

At batch 1 a frame is ~1,300 kernels of a few microseconds, each waiting for the one before to finish, launch
and ramp up (docs/benchmarks.md, issue 16). With PDL a kernel is launched while the one before it still runs:
it reads what does not depend on it (the GEMV's first chunk of weights) and then waits (`gdc_wait`, which
returns once the kernel before has completed and its writes are visible); after its own wait it lets the next
kernel launch (`gdc_launch_dependents`). Every kernel here waits before any read of an activation and before
any write, so the order of every read and write is the stream's; a torch kernel between two of them is
launched plainly and serialises as before. Off under Triton's interpreter and before sm90.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def enabled() -> bool:
    return (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


def opts() -> dict:
    """The launch options of a kernel with a PDL constexpr: {"PDL": on, "launch_pdl": on} (off: PDL=False only)."""
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}
