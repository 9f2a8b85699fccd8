"""Eviction aware of attention: StreamingLLM sinks + window, and H2O accumulated scores.

Both keep the EvictionPolicy contract (they are registered, so
``test_policy_contract.py`` runs them too); here: what their hints change,
and that without hints they fall back to FIFO and LRU.
"""
from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

import policies.h2o  # noqa: F401  registers "h2o"
import policies.streaming  # noqa: F401  registers "streaming"
from policies import available, make_policy
from tierkv.errors import ConfigError
from tierkv.policy import DescribesBlocks, EvictionPolicy, ObservesScores


def _fill(policy: EvictionPolicy, layers: int, blocks: int) -> list[tuple[int, int]]:
    """Blocks (layer, index) arriving chunk by chunk, as the native loop stores them."""
    keys = []
    for index in range(blocks):
        for layer in range(layers):
            key = (layer, index)
            policy.insert(key)
            policy.describe(key, layer=layer, index=index)
            keys.append(key)
    return keys


def test_both_are_registered_with_their_hints() -> None:
    assert {"streaming", "h2o"} <= set(available())
    assert isinstance(make_policy("streaming"), DescribesBlocks)
    assert isinstance(make_policy("h2o"), ObservesScores)
    assert not isinstance(make_policy("lru"), DescribesBlocks | ObservesScores)


# -- streaming -------------------------------------------------------------
def test_streaming_without_hints_is_fifo() -> None:
    streaming, fifo = make_policy("streaming"), make_policy("fifo")
    rng = random.Random(3)
    for _ in range(200):
        key, use = rng.randrange(30), rng.random() < 0.4
        for policy in (streaming, fifo):
            policy.touch(key) if use else policy.insert(key)
    assert streaming.evict(len(fifo), frozenset()) == fifo.evict(len(fifo), frozenset())


def test_streaming_evicts_the_middle_oldest_first_and_keeps_sinks_and_window() -> None:
    policy = make_policy("streaming", sinks=1, window=2)
    _fill(policy, layers=2, blocks=6)
    middle = [(layer, index) for index in (1, 2, 3) for layer in (0, 1)]  # arrival order
    assert policy.evict(6, frozenset()) == middle
    kept = {(layer, index) for layer in (0, 1) for index in (0, 4, 5)}
    assert set(policy.evict(len(policy), frozenset())) == kept


def test_the_window_follows_the_newest_block_of_each_layer() -> None:
    policy = make_policy("streaming", sinks=1, window=1)
    _fill(policy, layers=1, blocks=3)              # 0 sink, 1 middle, 2 window
    policy.insert((0, 3))
    policy.describe((0, 3), layer=0, index=3)      # 2 leaves the window
    assert policy.evict(2, frozenset()) == [(0, 1), (0, 2)]
    other_layer = (1, 1)
    policy.insert(other_layer)
    policy.describe(other_layer, layer=1, index=1)  # newest of layer 1: in its window
    assert policy.evict(1, frozenset()) == [(0, 3)]  # the window goes before the sink


def test_sinks_and_window_go_last_window_first_and_protection_still_holds() -> None:
    policy = make_policy("streaming", sinks=2, window=1)
    _fill(policy, layers=1, blocks=3)              # 0, 1 sinks; 2 window; no middle
    assert policy.evict(1, {(0, 2)}) == [(0, 0)]
    assert policy.evict(2, {(0, 2)}) is None
    assert len(policy) == 2
    assert policy.evict(2, frozenset()) == [(0, 2), (0, 1)]


def test_streaming_ignores_hints_for_keys_it_does_not_hold_and_forgets_removed_ones() -> None:
    policy = make_policy("streaming", sinks=1, window=0)
    policy.describe("ghost", layer=0, index=0)
    policy.insert("a")
    policy.describe("a", layer=0, index=None)      # unknown position: an ordinary block
    policy.insert("sink")
    policy.describe("sink", layer=0, index=0)
    policy.insert("b")
    assert len(policy) == 3
    policy.remove("sink")
    policy.insert("sink")                          # back without a hint: a middle block now
    assert policy.evict(3, frozenset()) == ["a", "b", "sink"]


@pytest.mark.parametrize("field,value", [("sinks", -1), ("window", "2"), ("sinks", True)])
def test_streaming_rejects_bad_counts_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{field}="):
        make_policy("streaming", **{field: value})


def _hits(policy: EvictionPolicy, steps: list[list[tuple[int, int]]], capacity: int) -> list[bool]:
    """A tier of ``capacity`` blocks read step by step; misses load the block and evict one."""
    resident: set[Hashable] = set()
    hits = []
    for step in steps:
        for key in step:
            hits.append(key in resident)
            if key in resident:
                policy.touch(key)
                continue
            if len(resident) >= capacity:
                resident.difference_update(policy.evict(1, {key}))
            policy.insert(key)
            if isinstance(policy, DescribesBlocks):
                policy.describe(key, layer=key[0], index=key[1])
            resident.add(key)
    return hits


def test_a_dense_scan_longer_than_the_tier_still_hits_sinks_and_window() -> None:
    blocks, capacity = 12, 6
    steps = [[(0, i) for i in range(blocks)] for _ in range(10)]
    lru = _hits(make_policy("lru"), steps, capacity)
    streaming = _hits(make_policy("streaming", sinks=1, window=2), steps, capacity)
    assert not any(lru[blocks:])  # a loop larger than the cache: LRU never hits
    per_pass = [sum(streaming[s:s + blocks]) for s in range(blocks, len(streaming), blocks)]
    assert min(per_pass) >= 3     # the sink and the two window blocks stay


# -- H2O -------------------------------------------------------------------
def test_h2o_without_scores_is_lru() -> None:
    h2o, lru = make_policy("h2o", capacity=10), make_policy("lru")
    rng = random.Random(5)
    for _ in range(300):
        key, roll = rng.randrange(25), rng.random()
        for policy in (h2o, lru):
            if roll < 0.5:
                policy.insert(key)
            elif roll < 0.8:
                policy.touch(key)
            elif roll < 0.9:
                policy.remove(key)
        if roll >= 0.9:
            protected = frozenset(rng.sample(range(25), 5))
            assert h2o.evict(2, protected) == lru.evict(2, protected)
    assert h2o.evict(len(lru), frozenset()) == lru.evict(len(lru), frozenset())


def test_h2o_evicts_the_lowest_accumulated_score_first() -> None:
    policy = make_policy("h2o")
    for key in "abcd":
        policy.insert(key)
    for key, score in [("a", 0.5), ("b", 0.2), ("a", 0.1), ("b", 0.3), ("c", 0.05)]:
        policy.observe(key, score)
    assert policy.score("a") == pytest.approx(0.6) and policy.score("b") == pytest.approx(0.5)
    policy.touch("d")  # a use does not outweigh attention
    assert policy.evict(4, frozenset()) == ["d", "c", "b", "a"]


def test_h2o_equal_scores_go_least_recently_used_first() -> None:
    policy = make_policy("h2o")
    for key in "abc":
        policy.insert(key)
        policy.observe(key, 1.0)
    policy.touch("a")
    assert policy.evict(3, frozenset()) == ["b", "c", "a"]


def test_h2o_scores_outlive_eviction_and_count_while_elsewhere() -> None:
    policy = make_policy("h2o", capacity=4)
    for key in "abc":
        policy.insert(key)
    policy.observe("a", 2.0)
    assert policy.evict(1, {"b", "c"}) == ["a"]
    policy.observe("a", 1.0)     # read from another tier meanwhile
    policy.observe("z", 5.0)     # never held here
    assert len(policy) == 2
    policy.insert("a")
    policy.insert("z")
    assert policy.score("a") == 3.0 and policy.score("z") == 5.0
    assert policy.evict(4, frozenset()) == ["b", "c", "a", "z"]
    policy.remove("z")           # gone for good: its score too
    assert policy.score("z") == 0.0


def test_h2o_remembers_a_bounded_number_of_ghosts() -> None:
    policy = make_policy("h2o", capacity=2, ghosts_per_block=3)
    for key in range(20):
        policy.observe(key, 1.0)
    remembered = [key for key in range(20) if policy.score(key)]
    assert remembered == list(range(14, 20))


def test_h2o_failed_evict_keeps_the_order_and_protected_keys_keep_their_place() -> None:
    policy, twin = make_policy("h2o"), make_policy("h2o")
    for p in (policy, twin):
        for i, key in enumerate("abcdef"):
            p.insert(key)
            p.observe(key, float(i % 3))
    assert policy.evict(3, set("abcd")) is None
    assert policy.evict(2, {"a", "d"}) == ["b", "e"]
    assert policy.evict(4, frozenset()) == [k for k in twin.evict(6, frozenset()) if k not in "be"]


def test_h2o_rejects_scores_that_are_not_finite() -> None:
    policy = make_policy("h2o")
    policy.insert("a")
    with pytest.raises(ValueError, match="score=nan"):
        policy.observe("a", float("nan"))
    assert policy.score("a") == 0.0


def test_h2o_many_observations_keep_the_heap_bounded() -> None:
    policy = make_policy("h2o")
    for key in range(50):
        policy.insert(key)
    for step in range(200):
        for key in range(50):
            policy.observe(key, 1.0 / (1 + (key + step) % 7))
    assert len(policy._heap) <= 2 * len(policy) + 33
    assert len(policy.evict(50, frozenset())) == 50


def test_h2o_keeps_heavy_hitters_a_sparse_reader_returns_to() -> None:
    """Each step reads 4 heavy blocks, then 8 of 60 others; the attention mass is reported per read."""
    rng = random.Random(11)
    heavy = [f"heavy{i}" for i in range(4)]
    steps = [[*heavy, *(f"cold{j}" for j in rng.sample(range(60), 8))] for _ in range(200)]

    def run(policy: EvictionPolicy, capacity: int = 8) -> float:
        resident: set[str] = set()
        hits = total = 0
        for step in steps:
            for key in step:
                total += 1
                if key in resident:
                    hits += 1
                    policy.touch(key)
                else:
                    if len(resident) >= capacity:
                        resident.difference_update(policy.evict(1, {key}))
                    policy.insert(key)
                    resident.add(key)
                if isinstance(policy, ObservesScores):
                    policy.observe(key, 0.2 if key.startswith("heavy") else 0.01)
        return hits / total

    lru, h2o = run(make_policy("lru")), run(make_policy("h2o", capacity=8))
    assert lru < 0.1 < 0.3 < h2o  # LRU lets the scan push the heavy blocks out every step
