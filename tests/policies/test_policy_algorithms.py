"""The mechanics of ARC and S3-FIFO, step by step (internal state only where noted)."""
from __future__ import annotations

import random

from policies import make_policy
from policies.arc import ARCPolicy
from policies.s3fifo import S3FIFOPolicy


def _arc_with_t2_xy_t1_b() -> ARCPolicy:
    """T2 = [x, y], T1 = [b], B1 = [a]."""
    arc = ARCPolicy(capacity=4)
    for key in "xyab":
        arc.insert(key)
    arc.touch("x")
    arc.touch("y")
    assert arc.evict(1, frozenset()) == ["a"]  # T1 is above its target of 0
    return arc


def test_arc_a_b1_ghost_hit_grows_t1_target_and_readmits_into_t2() -> None:
    arc = _arc_with_t2_xy_t1_b()
    arc.insert("a")
    assert arc.target_t1 == 1.0
    assert arc.evict(1, frozenset()) == ["x"]  # T1 = [b] is now within its target


def test_arc_a_b2_ghost_hit_shrinks_t1_target() -> None:
    arc = _arc_with_t2_xy_t1_b()
    arc.insert("a")
    assert arc.evict(1, frozenset()) == ["x"]
    arc.insert("x")
    assert arc.target_t1 == 0.0
    assert arc.evict(1, frozenset()) == ["b"]


def test_arc_falls_back_to_the_other_list_when_the_preferred_one_is_protected() -> None:
    arc = _arc_with_t2_xy_t1_b()
    assert arc.evict(1, frozenset({"b"})) == ["x"]
    assert arc.evict(1, frozenset({"y"})) == ["b"]


def test_arc_ghost_lists_stay_within_twice_the_capacity() -> None:
    arc = ARCPolicy(capacity=16)
    rng = random.Random(1)
    for _ in range(5000):
        key = rng.randrange(200)
        if len(arc) >= 16:
            arc.evict(1, frozenset())
        arc.insert(key) if rng.random() < 0.7 else arc.touch(key)
    # internal: the ghost lists are the only state that outlives the keys
    assert len(arc._t1) + len(arc._b1) <= 16
    assert len(arc) + len(arc._b1) + len(arc._b2) <= 32


def test_s3fifo_keys_never_reused_leave_before_reused_ones() -> None:
    policy = make_policy("s3fifo", capacity=10)
    for key in ["reused", *(f"once{i}" for i in range(9))]:
        policy.insert(key)
    policy.touch("reused")
    assert policy.evict(9, frozenset()) == [f"once{i}" for i in range(9)]


def test_s3fifo_a_key_remembered_by_the_ghost_comes_back_into_main() -> None:
    policy = make_policy("s3fifo", capacity=10)
    for key in ["a", "b", "c"]:
        policy.insert(key)
    assert policy.evict(1, frozenset()) == ["a"]
    policy.insert("a")  # the ghost remembers it: straight to main
    policy.insert("d")
    assert policy.evict(3, frozenset()) == ["b", "c", "d"]


def test_s3fifo_use_counter_caps_at_three() -> None:
    policy = S3FIFOPolicy(capacity=10)  # small share: 1 key
    for key in ["k", "j", "filler"]:
        policy.insert(key)
    policy.touch("k")
    policy.touch("j")
    assert policy.evict(1, frozenset()) == ["filler"]  # k and j move to main, counters cleared
    for _ in range(10):
        policy.touch("k")
    for _ in range(3):
        policy.touch("j")
    # both capped at 3: k is older in main, so it runs out of second chances first
    assert policy.evict(1, frozenset()) == ["k"]


def test_s3fifo_protected_keys_stay_at_the_old_end_in_order() -> None:
    policy = make_policy("s3fifo", capacity=10)
    for key in "abcdef":
        policy.insert(key)
    assert policy.evict(2, frozenset("ac")) == ["b", "d"]
    assert policy.evict(4, frozenset()) == ["a", "c", "e", "f"]


def test_s3fifo_ghost_stays_within_the_main_share() -> None:
    policy = S3FIFOPolicy(capacity=20)
    for key in range(1000):
        if len(policy) >= 20:
            policy.evict(1, frozenset())
        policy.insert(key)
    assert len(policy._ghost) <= 18  # internal: 90% of 20


def test_lru_cold_insert_goes_first_until_touched():
    lru = make_policy("lru")
    for k in "abc":
        lru.insert(k)
    lru.insert_cold("x")
    assert lru.evict(1, set()) == ["x"]
    lru.insert_cold("y")
    lru.touch("y")                  # used: now the most recent
    assert lru.evict(3, set()) == ["a", "b", "c"]
