"""Every registered policy keeps the EvictionPolicy contract (tierkv/policy.py).

Histories are random but seeded: building the same (policy, seed) twice gives
two policies in the same state, which lets a test compare one that saw an
operation with one that did not.
"""
from __future__ import annotations

import random
from collections.abc import Container, Hashable

import pytest

from policies import available, make_policy
from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.policy import EvictionPolicy, InsertsMany, TouchesMany, implements

NAMES = available()
SEEDS = range(6)
ORDERED = ["lru", "fifo", "lfu", "lfu-history"]  # strategies whose eviction order is a fixed ranking


def _universe(seed: int) -> list[Hashable]:
    """Small ints on even seeds, real block keys on odd ones."""
    return [BlockKey.of("block", i) if seed % 2 else i for i in range(30)]


def _random_protected(rng: random.Random, known: set[Hashable], universe: list[Hashable]) -> frozenset[Hashable]:
    picked = rng.sample(sorted(known, key=repr), rng.randint(0, len(known)))
    return frozenset(picked + rng.sample(universe, 2))  # unknown keys in protected are harmless


def drive(policy: EvictionPolicy, rng: random.Random, steps: int, universe: list[Hashable],
          model: set[Hashable]) -> list[list[Hashable] | None]:
    """Random inserts, touches, removes and evicts, checked against ``model``; returns what evict said."""
    said: list[list[Hashable] | None] = []
    for _ in range(steps):
        roll = rng.random()
        key = rng.choice(universe)
        if roll < 0.4:
            policy.insert(key)
            model.add(key)
        elif roll < 0.7:
            policy.touch(key)
        elif roll < 0.8:
            policy.remove(key)
            model.discard(key)
        else:
            said.append(_checked_evict(policy, rng, universe, model))
        assert len(policy) == len(model)
    return said


def _checked_evict(policy: EvictionPolicy, rng: random.Random, universe: list[Hashable],
                   model: set[Hashable]) -> list[Hashable] | None:
    protected = _random_protected(rng, model, universe)
    n = rng.randint(0, 4)
    victims = policy.evict(n, protected)
    evictable = model - protected
    if len(evictable) < n:
        assert victims is None, f"{len(evictable)} evictable keys cannot give {n} victims"
        return None
    assert victims is not None, f"{len(evictable)} evictable keys but evict({n}) gave None"
    assert len(victims) == n == len(set(victims))
    assert set(victims) <= evictable
    model.difference_update(victims)
    return victims


def history(name: str, seed: int, steps: int = 300) -> tuple[EvictionPolicy, set[Hashable]]:
    policy = make_policy(name, capacity=12)
    model: set[Hashable] = set()
    drive(policy, random.Random(seed), steps, _universe(seed), model)
    return policy, model


def drain(policy: EvictionPolicy) -> list[Hashable]:
    victims = policy.evict(len(policy), frozenset())
    assert victims is not None and len(policy) == 0
    assert policy.evict(1, frozenset()) is None
    return victims


@pytest.mark.parametrize("name", NAMES)
def test_satisfies_the_protocol_and_starts_empty(name: str) -> None:
    policy = make_policy(name)
    assert isinstance(policy, EvictionPolicy)
    assert len(policy) == 0
    assert policy.evict(0, frozenset()) == []
    assert policy.evict(1, frozenset()) is None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", NAMES)
def test_known_keys_match_the_model_after_random_operations(name: str, seed: int) -> None:
    policy, model = history(name, seed, steps=600)
    victims = drain(policy)
    assert len(victims) == len(set(victims))
    assert set(victims) == model


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", NAMES)
def test_evict_that_returns_none_changes_nothing(name: str, seed: int) -> None:
    policy, model = history(name, seed)
    twin, _ = history(name, seed)
    rng = random.Random(seed + 100)
    protected = _random_protected(rng, model, _universe(seed))
    assert policy.evict(len(model - protected) + 1, protected) is None
    assert policy.evict(len(model) + 1, frozenset()) is None
    assert policy.evict(1, frozenset(model)) is None

    # Same future for both: same answers, then the same eviction order.
    said = drive(policy, random.Random(seed + 200), 200, _universe(seed), set(model))
    assert said == drive(twin, random.Random(seed + 200), 200, _universe(seed), set(model))
    assert drain(policy) == drain(twin)


@pytest.mark.parametrize("name", NAMES)
def test_only_unprotected_keys_are_victims(name: str) -> None:
    policy = make_policy(name, capacity=20)
    keys = list(range(20))
    for key in keys:
        policy.insert(key)
    for key in keys[::3]:
        policy.touch(key)
    free = {3, 11, 17}
    protected = frozenset(keys) - free
    assert policy.evict(4, protected) is None
    victims = policy.evict(3, protected)
    assert victims is not None and len(victims) == 3 and set(victims) == free
    assert set(drain(policy)) == protected


@pytest.mark.parametrize("name", ORDERED)
@pytest.mark.parametrize("seed", SEEDS)
def test_protected_keys_keep_their_place(name: str, seed: int) -> None:
    policy, model = history(name, seed)
    twin, _ = history(name, seed)
    protected = _random_protected(random.Random(seed), model, _universe(seed))
    n = min(3, len(model - protected))
    victims = policy.evict(n, protected)
    assert victims is not None
    assert drain(policy) == [key for key in drain(twin) if key not in victims]


@pytest.mark.parametrize("name", NAMES)
def test_reinsert_touch_and_remove_of_unknown_keys_are_harmless(name: str) -> None:
    policy = make_policy(name)
    policy.insert("a")
    policy.insert("a")
    policy.touch("ghost")
    policy.remove("ghost")
    assert len(policy) == 1
    policy.remove("a")
    policy.remove("a")
    assert len(policy) == 0
    assert policy.evict(1, frozenset()) is None


@pytest.mark.parametrize("name", NAMES)
def test_negative_count_is_an_error(name: str) -> None:
    policy = make_policy(name)
    policy.insert("a")
    with pytest.raises(ValueError, match="n=-1"):
        policy.evict(-1, frozenset())
    assert len(policy) == 1


@pytest.mark.parametrize("capacity", [0, -5, True, "64"])
@pytest.mark.parametrize("name", NAMES)
def test_bad_capacity_names_the_field(name: str, capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity="):
        make_policy(name, capacity=capacity)


class _CountingSet(Container[Hashable]):
    def __init__(self, keys: set[Hashable]) -> None:
        self.keys, self.lookups = keys, 0

    def __contains__(self, key: object) -> bool:
        self.lookups += 1
        return key in self.keys


@pytest.mark.parametrize("name", NAMES)
def test_evict_work_grows_with_protected_keys_passed_plus_n(name: str) -> None:
    policy = make_policy(name, capacity=3000)
    for key in range(3000):
        policy.insert(key)
    protected = _CountingSet(set(range(1000)))  # the oldest third is pinned
    for _ in range(20):
        protected.lookups = 0
        assert policy.evict(5, protected) is not None
        assert protected.lookups <= 3 * (1000 + 5)


@pytest.mark.parametrize("name", NAMES)
def test_a_cold_block_is_first_to_go_until_it_is_used(name):
    """Where a policy admits cold (``AdmitsCold``), a guessed block goes before blocks in use, and a
    use lifts it: it is then not the next victim."""
    from tierkv.policy import AdmitsCold, implements
    policy = make_policy(name, capacity=8)
    if not implements(policy, AdmitsCold):
        pytest.skip(f"{name} admits every block alike")
    for k in range(4):
        policy.insert(k)
        policy.touch(k)
    policy.insert_cold("guess")
    assert policy.evict(1, frozenset()) == ["guess"]
    policy.insert_cold("used")
    policy.touch("used")
    assert policy.evict(1, frozenset()) != ["used"]


def test_fifo_does_not_admit_cold():
    from tierkv.policy import AdmitsCold, implements
    assert implements(make_policy("lru"), AdmitsCold) and not implements(make_policy("fifo"), AdmitsCold)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", [n for n in NAMES if implements(make_policy(n), TouchesMany)])
def test_touch_many_is_touch_of_each_key_in_order(name: str, seed: int) -> None:
    """A read's one call leaves the policy as one ``touch`` per key would (unknown keys included)."""
    policy, model = history(name, seed)
    twin, _ = history(name, seed)
    keys = random.Random(seed).sample(_universe(seed), 12)
    policy.touch_many(keys)
    for key in keys:
        twin.touch(key)
    assert drain(policy) == drain(twin)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", [n for n in NAMES if implements(make_policy(n), InsertsMany)])
def test_insert_many_is_insert_of_each_key_in_order(name: str, seed: int) -> None:
    """A load's one call leaves the policy as one ``insert`` per key would: keys new to it, keys it
    knows, and a key named twice."""
    rng = random.Random(seed)
    universe = _universe(seed) + [BlockKey.of("new", i) if seed % 2 else 100 + i for i in range(8)]
    for keys in (universe[30:], rng.sample(universe, 12), [universe[31], universe[2], universe[31]]):
        policy, _ = history(name, seed)
        twin, _ = history(name, seed)
        policy.insert_many(keys)
        for key in keys:
            twin.insert(key)
        assert drain(policy) == drain(twin)
