import tracemalloc

import numpy as np
import pytest

from tierkv.errors import BudgetExceeded
from tierkv.tiers.pool import BlockPool, SlotState


def test_lifecycle_and_lowest_slot_first():
    pool = BlockPool(3)
    a, b = pool.reserve(), pool.reserve()
    assert (a, b) == (0, 1) and pool.state(a) is SlotState.RESERVED
    pool.commit(a)
    pool.pin(a)
    with pytest.raises(ValueError, match="pinned"):
        pool.release(a)
    pool.unpin(a)
    pool.release(a)
    assert pool.state(a) is SlotState.FREE
    assert pool.reserve() == 0  # reused before new slots


def test_full_pool_raises_and_counts():
    pool = BlockPool(2)
    pool.reserve(), pool.reserve()
    assert pool.free == 0 and not pool.can_reserve()
    with pytest.raises(BudgetExceeded):
        pool.reserve()


def test_wrong_transitions_are_refused():
    pool = BlockPool(2)
    slot = pool.reserve()
    with pytest.raises(ValueError, match="reserved, expected ready"):
        pool.pin(slot)
    pool.commit(slot)
    with pytest.raises(ValueError, match="expected reserved"):
        pool.commit(slot)
    with pytest.raises(ValueError, match="unpin without pin"):
        pool.unpin(slot)
    pool.release(slot)
    with pytest.raises(ValueError, match="already free"):
        pool.release(slot)


def test_batch_transitions_match_single_ones_and_check_before_changing():
    pool = BlockPool(6)
    assert pool.reserve_many(3) == [0, 1, 2]
    pool.commit_many([0, 1])
    with pytest.raises(ValueError, match="slot=2: is reserved, expected ready"):
        pool.pin_many([0, 2])
    assert pool.pins(0) == 0                      # refused as a whole: slot 0 was not pinned either
    pool.pin_many([0, 1, 0])
    assert (pool.pins(0), pool.pins(1)) == (2, 1)
    with pytest.raises(ValueError, match="slot=1: unpin without pin"):
        pool.unpin_many([1, 1])
    assert pool.pins(1) == 1
    pool.unpin_many([0, 0, 1])
    pool.pin_many((1,))                           # distinct slots take the path without np.unique
    with pytest.raises(ValueError, match="slot=0: unpin without pin"):
        pool.unpin_many((1, 0))
    assert pool.pins(1) == 1                      # refused as a whole
    pool.unpin_many(np.array([1]))
    assert pool.pins(1) == 0
    pool.release_many([0, 2])
    assert pool.state(0) is SlotState.FREE and pool.state(2) is SlotState.FREE
    assert pool.reserve_many(4) == [0, 2, 3, 4]   # released slots first, lowest first, then new ones
    with pytest.raises(BudgetExceeded, match="2 asked"):
        pool.reserve_many(2)
    assert pool.used == 5                         # all or none


def test_restore_marks_specific_slots_ready():
    pool = BlockPool(10)
    pool.restore([5, 2])
    assert pool.state(5) is SlotState.READY and pool.used == 2
    assert [pool.reserve() for _ in range(4)] == [0, 1, 3, 4]
    assert pool.reserve() == 6
    with pytest.raises(ValueError, match="not been used"):
        pool.restore([7])
    with pytest.raises(ValueError, match="outside"):
        BlockPool(4).restore([4])


def test_restore_is_fast_for_large_stores_with_holes():
    pool = BlockPool(2_000_000)
    pool.restore(list(range(0, 1_000_000, 2)))
    assert pool.used == 500_000 and pool.reserve() == 1


def test_a_release_is_checked_whole_before_any_slot_is_freed():
    pool = BlockPool(8)
    slots = pool.reserve_many(4)
    pool.commit_many(slots)
    pool.pin(2)
    with pytest.raises(ValueError, match="slot=2: still pinned 1 time"):
        pool.release_many([0, 1, 2])
    with pytest.raises(ValueError, match="slot=1: already free"):
        pool.release_many([1, 1])                  # named twice: the second would free a free slot
    with pytest.raises(ValueError, match="slot=6: already free"):
        pool.release_many([0, 6])
    assert pool.slots_in_use() == [0, 1, 2, 3] and pool.used == 4   # nothing was freed
    pool.unpin(2)
    pool.release_many([3, 0])
    assert pool.slots_in_use() == [1, 2] and pool.reserve_many(3) == [0, 3, 4]


def test_a_huge_pool_costs_only_the_slots_it_has_used():
    tracemalloc.start()
    try:
        pool = BlockPool(10**12)                   # a petabyte of 1 KiB slots: nothing up front
        assert pool.reserve_many(3) == [0, 1, 2] and pool.state(10**11) is SlotState.FREE
        assert tracemalloc.get_traced_memory()[1] < 64 * 1024
    finally:
        tracemalloc.stop()


def test_generations_count_the_frees_of_each_slot_alone():
    """A memory tier's pool counts each slot's frees (what an unpinned reader checks), even across the
    arrays' growth and a failed release; a pool without them keeps nothing for it."""
    pool = BlockPool(10_000, generations=True)
    pool.commit_many(pool.reserve_many(5))
    pool.release_many([1, 3])
    assert pool.generations[:5].tolist() == [0, 1, 0, 1, 0]
    pool.pin(4)
    with pytest.raises(ValueError, match="still pinned"):
        pool.release_many([0, 4])                          # refused whole: no generation moves
    pool.commit_many(pool.reserve_many(5000))              # slots 1, 3 again, and the arrays grow
    pool.release_many([3, 4999])
    assert pool.generations[[0, 1, 3, 4999]].tolist() == [0, 1, 2, 1] and pool.nbytes() >= 9 * 5000
    plain = BlockPool(10_000)
    plain.commit_many(plain.reserve_many(5000))
    plain.release_many([3])
    assert plain.generations is None and plain.nbytes() < 9 * 5000
