"""AffinityRouter: Ray Serve's request router for csmserve replicas (runs in each Serve proxy and handle).

A request may carry an affinity key (`RequestMetadata.session_id`: the `x-session-id` header, set by
the client or by the proxy middleware from the body, csmserve/ray/affinity.py): a conversation
(`context_id`, or the first context turn) or a stored voice. Replicas whose prefix cache holds that
key's prompt prefix are the ones that served it before, so a key has a fixed order of replicas
(rendezvous hashing: adding or losing a replica moves only the keys that were on it) and goes to the
first one whose load is under the bound (consistent hashing with bounded loads): ongoing requests <
load_factor x (the mean + 1). A hot voice therefore spills onto its second replica, then its third,
rather than queueing on one. Every other key (a named conversation, `ctx:`: a WebSocket's or a
request's `context_id`; a client's own x-session-id) is stricter: a session lives on its replica, so it
leaves only a replica Ray finds full (max_ongoing_requests). Without a key: the less loaded of two
random replicas (power of two choices), at equal loads the one this router sent fewer to, so idle
replicas take turns; the other is the fallback (tried if the first is full or does not answer Ray's
probe in time).
Replicas whose engine failed (routing stats `fatal`) get nothing while another is left.

Replica loads are Ray's own counts of ongoing requests per replica (the router's queue-length cache,
refreshed by its probes and by every request it sends), plus the keyed requests this router chose a
replica for and has not sent yet (a burst is routed before the first of it is sent: without these, the
whole burst of a hot voice would land on its one replica); an open WebSocket counts as one.
"""
from __future__ import annotations

import hashlib
import math
import random
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


BOUNDED = ("voice:", "conv:")  # keys of a cache only (affinity.py): these spill past the load bound
RESERVATION_S = 2.0  # a chosen-but-not-sent request counts on its replica until sent, or this long


def _weight(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """The replicas in `key`'s order of preference (highest random weight first)."""
    return sorted(replicas, key=lambda r: _weight(key, r), reverse=True)


def preference(key: str, replicas: Sequence[str], loads: Mapping[str, int], load_factor: float) -> list[str]:
    """The order in which a request with `key` tries the replicas: its rendezvous order, those at or
    over the load bound moved to the end (still in that order); keys of a session (not BOUNDED) keep
    the plain order."""
    if not replicas or not key.startswith(BOUNDED):
        return rendezvous(key, replicas)
    bound = math.ceil(load_factor * (sum(loads.get(r, 0) for r in replicas) + 1) / len(replicas))
    order = rendezvous(key, replicas)
    under = [r for r in order if loads.get(r, 0) < bound]
    return under + [r for r in order if loads.get(r, 0) >= bound]


def unkeyed(replicas: Sequence[str], load: Callable[[str], int], sent: Mapping[str, int],
            rng: random.Random | None = None) -> list[str]:
    """Two random replicas in the order a request without a key tries them: the less loaded first;
    at equal loads the one sent fewer requests. Ray's own tie-break would favour whichever replica
    answers its queue-length probe first, or the one already in its cache. load(replica) is read for
    the two sampled replicas only."""
    pair = (rng or random).sample(list(replicas), min(2, len(replicas)))
    return sorted(pair, key=lambda r: (load(r), sent.get(r, 0)))


class AffinityRouter(RequestRouter):
    """request_router_kwargs: load_factor (RayConfig.affinity_load_factor)."""

    load_factor = 1.25

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reserved: dict[str, deque[float]] = defaultdict(deque)  # replica -> when each was chosen
        self._sent: dict[str, int] = defaultdict(int)  # replica -> unkeyed requests this router chose it for

    def initialize_state(self, load_factor: float = 1.25, **kwargs) -> None:
        self.load_factor = float(load_factor)

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)  # Ray's count has it now
        reserved = self._reserved.get(replica_id.unique_id)
        if reserved:
            reserved.popleft()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all ranks tried: back off before again
        healthy = [r for r in candidate_replicas if not (r.routing_stats or {}).get("fatal")] or candidate_replicas
        if not healthy:
            return []
        key = pending_request.metadata.session_id if pending_request is not None else ""
        by_id = {r.replica_id.unique_id: r for r in healthy}
        if not key or len(healthy) == 1:
            order = unkeyed(list(by_id), lambda rid: self._load(by_id[rid]), self._sent)
            self._sent[order[0]] += 1
            return [[by_id[rid]] for rid in order]
        loads = {rid: self._load(r) for rid, r in by_id.items()}  # the bound is over the mean of every replica
        order = preference(key, list(by_id), loads, self.load_factor)
        if key.startswith(BOUNDED):
            self._reserved[order[0]].append(time.monotonic())
        return [[by_id[rid]] for rid in order]

    def _load(self, replica: RunningReplica) -> int:
        n = self.replica_queue_len_cache.get(replica.replica_id)
        reserved = self._reserved[replica.replica_id.unique_id]
        while reserved and reserved[0] < time.monotonic() - RESERVATION_S:
            reserved.popleft()
        return (0 if n is None else int(n)) + len(reserved)
