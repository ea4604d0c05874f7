"""The router's choice (csmserve/ray/router.py): a key's rendezvous order, bounded by load."""
from collections import Counter

import pytest

pytest.importorskip("ray.serve.request_router")
import random  # noqa: E402

from csmserve.ray.router import preference, rendezvous, unkeyed  # noqa: E402

REPLICAS = ["r0", "r1", "r2", "r3"]


def test_a_key_keeps_its_replica_while_under_the_bound():
    first = rendezvous("voice:a", REPLICAS)[0]
    loads = {r: 3 for r in REPLICAS}
    assert preference("voice:a", REPLICAS, loads, 1.25)[0] == first  # equal loads: its own replica
    assert rendezvous("voice:a", list(reversed(REPLICAS))) == rendezvous("voice:a", REPLICAS)  # order-free


def test_a_hot_key_spills_onto_its_next_replica_in_a_fixed_order():
    order = rendezvous("voice:hot", REPLICAS)
    loads = {r: 0 for r in REPLICAS}
    placed = []
    for _ in range(12):  # each request stays (load +1), as a burst of one voice does
        r = preference("voice:hot", REPLICAS, loads, 1.25)[0]
        placed.append(r)
        loads[r] += 1
    assert placed[0] == order[0]  # it starts on its own replica
    assert len(set(placed)) >= 3 and max(Counter(placed).values()) <= 4  # spread: none past 1.25 x the mean
    used = list(dict.fromkeys(placed))
    assert used == order[:len(used)]  # spilling follows the key's order: the replicas that cached it first


def test_a_named_conversation_stays_whatever_the_load():
    order = rendezvous("ctx:talk", REPLICAS)
    loads = {order[0]: 40, order[1]: 0, order[2]: 0, order[3]: 0}
    assert preference("ctx:talk", REPLICAS, loads, 1.25) == order  # Ray skips a full replica itself


def test_the_full_order_is_tried_with_overloaded_replicas_last():
    order = rendezvous("conv:x", REPLICAS)
    loads = {order[0]: 50, order[1]: 0, order[2]: 0, order[3]: 0}
    assert preference("conv:x", REPLICAS, loads, 1.25) == [order[1], order[2], order[3], order[0]]


def test_keys_spread_and_losing_a_replica_moves_only_its_keys():
    keys = [f"voice:{i}" for i in range(2000)]
    home = {k: rendezvous(k, REPLICAS)[0] for k in keys}
    counts = Counter(home.values())
    assert min(counts.values()) > 400  # ~500 each
    left = [r for r in REPLICAS if r != "r2"]
    for k in keys:
        if home[k] != "r2":
            assert rendezvous(k, left)[0] == home[k]


def test_unkeyed_requests_go_to_the_less_loaded_of_two_and_idle_replicas_take_turns():
    rng = random.Random(0)
    assert unkeyed(["r0", "r1"], {"r0": 3, "r1": 1}.__getitem__, {}, rng) == ["r1", "r0"]  # less loaded first
    sent: Counter = Counter()
    for _ in range(10):  # sequential requests on idle replicas: load 0 each time
        first = unkeyed(["r0", "r1"], lambda r: 0, sent, rng)[0]
        sent[first] += 1
    assert sent == {"r0": 5, "r1": 5}
    picks = Counter(unkeyed(REPLICAS, lambda r: {"r3": 9}.get(r, 0), {}, rng)[0] for _ in range(400))
    assert picks["r3"] == 0 and min(picks[r] for r in REPLICAS[:3]) > 80  # two random: r3 never wins
    assert unkeyed(["r0"], lambda r: 0, {}, rng) == ["r0"]
    read: list[str] = []
    unkeyed(REPLICAS, lambda r: read.append(r) or 0, {}, rng)
    assert len(set(read)) == 2  # only the sampled pair's loads are read, not every replica's
