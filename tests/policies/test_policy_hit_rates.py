"""Textbook workloads: a cache of fixed size driven by a trace, counting hits.

``simulate`` plays the manager: a hit touches the key; a miss evicts one
victim when the cache is full (never one of the ``pinned`` most recent
accesses, like blocks of the request being served), then inserts the key.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable, Sequence

import pytest

from policies import make_policy
from tierkv.errors import ConfigError
from tierkv.policy import EvictionPolicy

SCAN_RESISTANT = ["lfu", "arc", "s3fifo"]


def simulate(policy: EvictionPolicy, trace: Sequence[Hashable], capacity: int, pinned: int = 0) -> list[bool]:
    resident: set[Hashable] = set()
    recent: deque[Hashable] = deque(maxlen=pinned)
    hits: list[bool] = []
    for key in trace:
        recent.append(key)
        hits.append(key in resident)
        if key in resident:
            policy.touch(key)
            continue
        if len(resident) >= capacity:
            victims = policy.evict(1, frozenset(recent))
            assert victims is not None and victims[0] not in recent
            resident.difference_update(victims)
        policy.insert(key)
        resident.add(key)
    assert len(policy) == len(resident)
    return hits


def hit_ratio(trace: Sequence[Hashable], hits: Sequence[bool], start: int, prefix: str = "") -> float:
    counted = [hit for key, hit in zip(trace[start:], hits[start:], strict=True) if str(key).startswith(prefix)]
    return sum(counted) / len(counted)


def hot_set_and_scans(rounds: int = 20, hot: int = 40, scan: int = 150) -> tuple[list[str], int]:
    """Three warm-up passes over a hot set, then rounds of (hot set, one-time scan longer than the cache)."""
    rng = random.Random(7)
    hot_keys = [f"hot{i}" for i in range(hot)]
    trace = [key for _ in range(3) for key in rng.sample(hot_keys, hot)]
    start = len(trace)
    for r in range(rounds):
        trace += rng.sample(hot_keys, hot) + [f"scan{r}.{i}" for i in range(scan)]
    return trace, start


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu", "arc"])
def test_a_loop_one_larger_than_the_cache_never_hits(name: str) -> None:
    # LFU sees no reuse to count; ARC's T1 fills the cache, leaving B1 no room.
    trace = [i for _ in range(20) for i in range(9)]
    assert sum(simulate(make_policy(name, capacity=8), trace, capacity=8)) == 0


def test_s3fifo_ghost_turns_a_loop_one_larger_than_the_cache_into_hits() -> None:
    trace = [i for _ in range(20) for i in range(9)]
    assert sum(simulate(make_policy("s3fifo", capacity=8), trace, capacity=8)) >= len(trace) // 2


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu", "arc", "s3fifo"])
def test_a_loop_that_fits_misses_only_once_per_key(name: str) -> None:
    trace = [i for _ in range(10) for i in range(8)]
    assert sum(simulate(make_policy(name), trace, capacity=8)) == len(trace) - 8


def test_lru_keeps_the_recently_used_key_and_fifo_does_not() -> None:
    victims = {}
    for name in ("lru", "fifo"):
        policy = make_policy(name)
        for key in "abc":
            policy.insert(key)
        policy.touch("a")
        victims[name] = policy.evict(1, frozenset())
    assert victims == {"lru": ["b"], "fifo": ["a"]}


def test_inserting_a_resident_key_again_is_a_use_for_lru_but_not_for_fifo() -> None:
    victims = {}
    for name in ("lru", "fifo"):
        policy = make_policy(name)
        for key in "abca":
            policy.insert(key)
        victims[name] = policy.evict(3, frozenset())
    assert victims == {"lru": ["b", "c", "a"], "fifo": ["a", "b", "c"]}


def test_lfu_keeps_a_hot_key_that_lru_loses() -> None:
    trace = ["hot"] * 10 + [key for i in range(50) for key in [*(f"u{i}.{j}" for j in range(5)), "hot"]]
    start = 10
    lfu = simulate(make_policy("lfu"), trace, capacity=4)
    lru = simulate(make_policy("lru"), trace, capacity=4)
    assert hit_ratio(trace, lfu, start, "hot") == 1.0
    assert hit_ratio(trace, lru, start, "hot") == 0.0


def test_lfu_history_keeps_the_keys_every_pass_uses_when_a_pass_outgrows_the_tier() -> None:
    """Sparse decode's pattern: each pass (a step) uses more keys than fit, some of them every pass
    ("hot"), others every other pass. Under LRU and LFU a hot key is evicted, at count 1, before
    its next use; lfu-history gives it its count back, so the hot keys settle in."""
    cold = [f"cold{i}" for i in range(12)]
    trace = [key for p in range(30) for key in [*(f"hot{i}" for i in range(4)), *cold[6 * (p % 2):][:6]]]
    start = len(trace) // 3
    ratios = {name: hit_ratio(trace, simulate(make_policy(name), trace, capacity=6), start, "hot")
              for name in ("lru", "lfu", "lfu-history")}
    assert ratios == {"lru": 0.0, "lfu": 0.0, "lfu-history": 1.0}


def test_lfu_history_resumes_a_returning_keys_count_and_forgets_removed_ones() -> None:
    for name, victim in (("lfu", "a"), ("lfu-history", "b")):
        policy = make_policy(name, capacity=2)
        policy.insert("a")
        policy.touch("a")
        policy.touch("a")                       # a used 3 times
        assert policy.evict(1, frozenset()) == ["a"]
        policy.insert("b")
        policy.touch("b")                       # b: 2 uses
        policy.insert("a")                      # lfu: 1 use; lfu-history: 4
        assert policy.evict(1, frozenset()) == [victim], name
    assert policy.count("b") == 2 and policy.count("a") == 4
    policy.remove("b")
    assert policy.count("b") == 0


def test_lfu_history_remembers_a_bounded_number_of_evicted_keys() -> None:
    policy = make_policy("lfu-history", capacity=2, ghosts_per_block=1)
    for key in "abcde":
        policy.insert(key)
        policy.touch(key)
    assert policy.evict(5, frozenset()) == list("abcde")
    assert [policy.count(k) for k in "abcde"] == [0, 0, 0, 2, 2]   # the two newest ghosts
    with pytest.raises(ConfigError, match="ghosts_per_block"):
        make_policy("lfu-history", ghosts_per_block=-1)


def test_lfu_breaks_ties_by_recency() -> None:
    policy = make_policy("lfu")
    for key in "abc":
        policy.insert(key)
    policy.touch("b")
    policy.touch("a")  # a and b both used twice, b longer ago
    assert policy.evict(3, frozenset()) == ["c", "b", "a"]


@pytest.mark.parametrize("pinned", [0, 30])
@pytest.mark.parametrize("capacity_hint", [100, None])
def test_a_hot_set_survives_one_time_scans_only_under_scan_resistant_policies(
    pinned: int, capacity_hint: int | None
) -> None:
    trace, start = hot_set_and_scans()
    ratio = {
        name: hit_ratio(trace, simulate(make_policy(name, capacity=capacity_hint), trace, 100, pinned), start, "hot")
        for name in ["lru", "fifo", *SCAN_RESISTANT]
    }
    for name in SCAN_RESISTANT:
        assert ratio[name] >= 0.95, ratio
    assert ratio["lru"] <= 0.1 and ratio["fifo"] <= 0.1, ratio


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo"])
def test_a_shifted_working_set_takes_over_where_lfu_stays_stuck(name: str) -> None:
    rng = random.Random(3)
    old, new = [f"old{i}" for i in range(40)], [f"new{i}" for i in range(40)]
    trace = [key for _ in range(20) for key in rng.sample(old, 40)]
    start = len(trace)
    trace += [key for _ in range(30) for key in rng.sample(new, 40)]
    adaptive = hit_ratio(trace, simulate(make_policy(name), trace, capacity=50), start)
    lfu = hit_ratio(trace, simulate(make_policy("lfu"), trace, capacity=50), start)
    assert adaptive >= 0.9 and lfu <= 0.3, (adaptive, lfu)
