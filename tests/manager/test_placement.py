"""Placement decisions, asked directly: plain tiers (a pool and a medium) and a directory, no event loop."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from policies.victims import first_unprotected
from tierkv.keys import BlockKey
from tierkv.manager import placement
from tierkv.manager.directory import Directory
from tierkv.tiers.base import Medium
from tierkv.tiers.pool import BlockPool

from conftest import key

ORDER = ["gpu", "cpu", "nvme"]


@dataclass
class PlainTier:
    medium: Medium
    slots: int
    reads_in_place: bool = True
    pool: BlockPool = field(init=False)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.slots)


def tiers(gpu: int = 2, cpu: int = 4, nvme: int = 8) -> dict[str, PlainTier]:
    return {"gpu": PlainTier(Medium.GPU, gpu), "cpu": PlainTier(Medium.CPU, cpu), "nvme": PlainTier(Medium.NVME, nvme)}


def store(directory: Directory, tiers: dict[str, PlainTier], i: int, *where: str, protected: bool = False) -> BlockKey:
    """Block ``i`` resident (a committed slot) in each tier of ``where``."""
    entry = directory.add(key(i), hold=protected)
    for name in where:
        slot = tiers[name].pool.reserve()
        tiers[name].pool.commit(slot)
        entry.copies[name] = slot
    return key(i)


def test_a_put_tries_the_tier_asked_for_or_every_tier_fastest_first() -> None:
    assert placement.put_order(None, ORDER) == ORDER
    assert placement.put_order("cpu", ORDER) == ["cpu"]
    with pytest.raises(ValueError, match="tier='ssd': not configured; tiers: gpu, cpu, nvme"):
        placement.put_order("ssd", ORDER)


def test_a_free_slot_anywhere_beats_evicting_from_the_fastest_tier() -> None:
    t, d = tiers(gpu=1, cpu=1), Directory()
    assert placement.put_attempts(ORDER, t) == [("gpu", 1)]
    store(d, t, 0, "gpu")
    assert placement.put_attempts(ORDER, t) == [("cpu", 1)]
    store(d, t, 1, "cpu")
    assert placement.put_attempts(["gpu", "cpu"], t) == [("gpu", 1), ("cpu", 1)]   # all full: each makes room


def test_a_put_of_many_blocks_fills_free_slots_fastest_first_then_makes_room_for_what_each_tier_holds() -> None:
    t, d = tiers(gpu=3, cpu=4), Directory()
    store(d, t, 0, "gpu")
    assert placement.put_attempts(ORDER, t, 5) == [("gpu", 2)]             # the rest: the next call's
    store(d, t, 1, "gpu")
    store(d, t, 2, "gpu")
    assert placement.put_attempts(ORDER, t, 5) == [("cpu", 4)]
    for i in range(3, 7):
        store(d, t, i, "cpu")
    assert placement.put_attempts(["gpu", "cpu"], t, 5) == [("gpu", 3), ("cpu", 4)]
    assert placement.put_attempts(["gpu", "cpu"], tiers(gpu=0, cpu=0), 5) == [("gpu", 1), ("cpu", 1)]  # none: reserve raises


def test_a_modelled_pool_is_read_in_place_only_when_it_is_the_only_memory() -> None:
    t = {"cpu": PlainTier(Medium.CPU, 1), "cxl": PlainTier(Medium.CXL, 1, reads_in_place=False),
         "nvme": PlainTier(Medium.NVME, 1)}
    assert placement.memory_tiers(list(t), t) == ["cpu", "cxl"]
    assert placement.in_place_tiers(list(t), t) == ["cpu"]
    assert placement.in_place_tiers(["cxl", "nvme"], t) == ["cxl"]


def test_a_load_copies_from_the_fastest_tier_holding_the_block() -> None:
    t, d = tiers(), Directory()
    store(d, t, 0, "cpu", "nvme")
    assert placement.load_source(d.entry(key(0)), ORDER) == "cpu"
    assert placement.load_source(d.entry(key(0)), ["gpu"]) is None
    assert placement.tier_below(ORDER, "gpu") == "cpu" and placement.tier_below(ORDER, "nvme") is None


def test_pinned_wanted_and_last_protected_copies_are_not_evictable() -> None:
    t, d = tiers(gpu=3), Directory()
    free = store(d, t, 0, "gpu")
    pinned = store(d, t, 1, "gpu")
    t["gpu"].pool.pin(d.entry(pinned).copies["gpu"])
    wanted = store(d, t, 2, "gpu")
    d.want([(wanted, "gpu")])
    kept = store(d, t, 3, "nvme", protected=True)        # the only copy, in the last tier
    movable = store(d, t, 4, "cpu", protected=True)      # the only copy, but it can go down
    verdict = {k: placement.evictable(k, name, d, t, ORDER)
               for k, name in [(free, "gpu"), (pinned, "gpu"), (wanted, "gpu"), (kept, "nvme"), (movable, "cpu")]}
    assert verdict == {free: True, pinned: False, wanted: False, kept: False, movable: True}
    assert placement.evictable(key(99), "gpu", d, t, ORDER)   # stale in a policy: harmless
    guard = placement.Unevictable("gpu", d, t, ORDER)
    assert pinned in guard and free not in guard
    d.unwant([(wanted, "gpu")])
    assert placement.evictable(wanted, "gpu", d, t, ORDER)


def test_victims_go_down_while_memory_below_has_room_and_the_only_protected_copy_always() -> None:
    t, d = tiers(gpu=4, cpu=2), Directory()
    a, b = store(d, t, 0, "gpu"), store(d, t, 1, "gpu")
    in_both = store(d, t, 2, "gpu", "cpu")
    only = store(d, t, 3, "gpu", protected=True)
    room = placement.room_below("gpu", ORDER, t)
    assert room == 1
    demote, drop = placement.split_victims([a, b, in_both, only], "gpu", d, ORDER, room)
    assert demote == [a, only]        # a takes the one free slot; the protected block must not be lost
    assert drop == [b, in_both]       # b is plain cache; in_both has a copy below already


def test_nothing_is_demoted_to_the_store_to_keep_it_warm() -> None:
    t, d = tiers(), Directory()
    assert placement.room_below("cpu", ORDER, t) == 0     # the store is below: a write, not a warm copy
    assert placement.room_below("nvme", ORDER, t) == 0
    cache, kept = store(d, t, 0, "cpu"), store(d, t, 1, "cpu", protected=True)
    assert placement.split_victims([cache, kept], "cpu", d, ORDER, 0) == ([kept], [cache])


@pytest.mark.parametrize("name", ["cpu", "nvme"])
def test_screening_candidates_in_a_batch_agrees_with_asking_one_by_one(name: str) -> None:
    """Unevictable.screen (one lookup for a policy's batch of candidates) says what ``in`` says."""
    t, d = tiers(gpu=2, cpu=8, nvme=16), Directory()
    keys = [store(d, t, 0, "cpu"), store(d, t, 1, "cpu", "nvme", protected=True), store(d, t, 2, "nvme", protected=True),
            store(d, t, 3, "nvme"), store(d, t, 4, "cpu", protected=True), store(d, t, 5, "gpu"), key(99)]
    t["cpu"].pool.pin(d.get(key(0)).copies["cpu"])
    d.want([(key(3), name), (key(4), name)])
    guard = placement.Unevictable(name, d, t, ORDER)
    assert guard.screen(keys) == [k in guard for k in keys]
    assert any(guard.screen(keys)) and not all(guard.screen(keys))
    assert first_unprotected(keys, 2, guard) == first_unprotected(keys, 2, set(k for k in keys if k in guard))
