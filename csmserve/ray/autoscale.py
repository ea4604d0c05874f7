"""Ray Serve's autoscaling on the streams the replicas hold: requests reach the replicas through HAProxy,
never Serve's handles, so Serve's own count of ongoing requests stays 0. Each replica reports `active` (its
engine's requests running and waiting, CSMServeReplica.record_autoscaling_stats); this policy asks for as
many replicas as carry them at `target_ongoing_requests` each (Serve then applies min/max_replicas, the
up/downscale delays and factors).

Serve pickles this module by value into its controller: it imports nothing of csmserve.
"""
from __future__ import annotations

import math

POLICY = "csmserve.ray.autoscale:active_streams"
METRIC = "active"


def desired_replicas(active: dict, target: float, current: int) -> float:
    """Replicas for `active` streams (by replica) at `target` each; no report yet: as many as now."""
    if not active:
        return current
    return math.fsum(active.values()) / target


def active_streams(ctx) -> tuple[float, dict]:
    """AutoscalingPolicy.policy_function: (replicas wanted, the policy's state)."""
    active = (ctx.aggregated_metrics or {}).get(METRIC, {})
    return desired_replicas(active, ctx.config.get_target_ongoing_requests(), ctx.current_num_replicas), {}
