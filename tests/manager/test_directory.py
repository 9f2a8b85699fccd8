"""The directory's rows: views that go stale safely, bulk lookups equal to one-by-one ones, a million blocks in arrays."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey
from tierkv.manager.directory import Directory


def key(i: int) -> BlockKey:
    return BlockKey.of("directory", i)


def test_a_view_of_a_forgotten_block_reads_empty_after_its_row_is_reused() -> None:
    d = Directory()
    old = d.add(key(1), hold=True, layer=2, index=7)
    old.copies["cpu"] = 5
    assert (old.holders, old.layer, old.index, dict(old.copies)) == (1, 2, 7, {"cpu": 5})
    old.copies.pop("cpu")
    d.forget_if_empty(key(1))
    new = d.add(key(2), hold=False)          # takes the forgotten row
    new.copies["nvme"] = 9
    assert not old.live and old.holders == 0 and not old.copies and old.layer is None
    old.copies["cpu"] = 1                    # writes through a stale view go nowhere
    old.holders = 4
    assert dict(new.copies) == {"nvme": 9} and new.holders == 0 and key(1) not in d


def test_bulk_lookups_agree_with_entries_one_by_one() -> None:
    d = Directory()
    for i in range(300):
        entry = d.add(key(i), hold=i % 3 == 0)
        if i % 2:
            entry.copies["cpu"] = i
        if i % 5:
            entry.copies["nvme"] = 1000 + i
    keys = [key(i) for i in range(300)]
    found = d.find(keys + [key(999)], ["cpu", "nvme"])
    assert found[:-1] == [("cpu", i) if i % 2 else ("nvme", 1000 + i) if i % 5 else None for i in range(300)]
    assert found[-1] is None
    holders, copies, has_cpu = d.counts(keys, "cpu")
    assert holders.tolist() == [d.get(k).holders for k in keys]
    assert copies.tolist() == [len(d.get(k).copies) for k in keys]
    assert has_cpu.tolist() == ["cpu" in d.get(k).copies for k in keys]
    assert d.slots_in(keys, "nvme").tolist() == [1000 + i if i % 5 else -1 for i in range(300)]
    with pytest.raises(BlockMissing):
        d.rows([key(1), key(999)])
    loads, joins = d.plan_loads([key(i) for i in (1, 2, 5)], "cpu", ["cpu", "nvme"])
    assert loads == {"nvme": [key(2)]} and joins == []   # 1 and 5 are in the cpu tier already
    with pytest.raises(BlockMissing):
        d.plan_loads([key(999)], "cpu", ["cpu", "nvme"])


@pytest.mark.parametrize("twice", [False, True])
def test_adding_many_keys_at_once_agrees_with_adding_them_one_by_one(twice) -> None:
    """Over known keys (stored or not), new ones and rows freed for reuse; ``twice``: a new key named
    twice in the call (made once, held twice)."""
    one, many = Directory(), Directory()
    for d in (one, many):
        for i in range(40):
            entry = d.add(key(i), hold=i % 2 == 0, layer=1, index=i)
            if i % 3:
                entry.copies["cpu"] = i
        d.forget_if_empty(key(3))                              # a row free for reuse
    keys = [key(i) for i in (5, 6, 3, 41, 42, 7)] + ([key(41)] if twice else [])
    expected = [i % 3 != 0 and i < 40 for i in (5, 6, 3, 41, 42, 7)] + ([False] if twice else [])
    for i, k in enumerate(keys):
        one.add(k, hold=True, layer=4, index=20 + i)
    assert many.add_many(keys, hold=True, layer=4, first_index=20).tolist() == expected
    for k in {*keys, *map(key, range(45))}:
        a, b = one.get(k), many.get(k)
        assert (a and (a.holders, a.layer, a.index, dict(a.copies))) == (b and (b.holders, b.layer, b.index,
                                                                                  dict(b.copies)))
    assert one.get(key(41)).holders == (2 if twice else 1)


def test_the_held_count_is_the_entries_held_after_holds_releases_and_reused_rows() -> None:
    d = Directory()
    for i in range(50):
        d.add(key(i), hold=i % 4 == 0).copies["cpu"] = i
    d.let_go([key(0), key(4)])
    for i in (0, 1, 2):                      # forgotten: their rows are reused below
        d.get(key(i)).copies.pop("cpu")
        d.forget_if_empty(key(i))
    d.add(key(100), hold=False).copies["cpu"] = 1
    d.add(key(101), hold=True).copies["cpu"] = 2
    assert d.held_count() == sum(1 for entry in d if entry.holders) == 12


def test_moves_in_flight_are_joined_and_settled() -> None:
    loop = asyncio.new_event_loop()
    try:
        d = Directory()
        for i in range(4):
            d.add(key(i), hold=False).copies["nvme"] = i
        done = loop.create_future()
        d.arrive([key(0), key(1)], "cpu", done)
        loads, joins = d.plan_loads([key(0), key(1), key(2)], "cpu", ["cpu", "nvme"])
        assert loads == {"nvme": [key(2)]} and joins == [(key(0), done), (key(1), done)]
        d.commit([key(0)], "cpu", [3])
        d.settle([key(0), key(1)], "cpu", done)
        assert not d.get(key(0)).arriving and dict(d.get(key(0)).copies) == {"nvme": 0, "cpu": 3}
    finally:
        loop.close()


def test_a_block_joining_a_second_move_leaves_the_other_blocks_of_the_first_as_they_were() -> None:
    """The blocks of one move share one record of their moves in flight: a second move of one of them,
    and the first move's settling, change that block's record alone."""
    loop = asyncio.new_event_loop()
    try:
        d = Directory()
        for i in range(3):
            d.add(key(i), hold=False).copies["nvme"] = i
        to_cpu, to_gpu = loop.create_future(), loop.create_future()
        d.arrive([key(0), key(1), key(2)], "cpu", to_cpu)
        d.arrive([key(1)], "gpu", to_gpu)
        assert [dict(d.get(key(i)).arriving) for i in range(3)] == [{"cpu": to_cpu}, {"cpu": to_cpu, "gpu": to_gpu},
                                                                    {"cpu": to_cpu}]
        d.settle([key(0), key(1), key(2)], "cpu", to_cpu)
        assert [dict(d.get(key(i)).arriving) for i in range(3)] == [{}, {"gpu": to_gpu}, {}]
        assert d.plan_loads([key(1)], "gpu", ["gpu", "cpu", "nvme"]) == ({}, [(key(1), to_gpu)])
        d.settle([key(1), key(1)], "gpu", to_gpu)      # a key named twice settles once
        assert not d.get(key(1)).arriving
        d.arrive([key(0)], "cpu", to_cpu)
        d.settle([key(2), key(0), key(0)], "cpu", to_cpu)
        assert not d.get(key(0)).arriving
    finally:
        loop.close()


def test_rows_a_reader_guessed_are_checked_and_spare_the_next_lookups() -> None:
    d = Directory()
    for i in range(40):
        d.add(key(i), hold=False).copies["nvme"] = i
    keys = [key(i) for i in range(40)]
    rows = d.find_rows(keys)
    wrong = rows.copy()
    wrong[[3, 7]] = wrong[[7, 3]]                    # two guesses swapped: each names another key's row
    wrong[9] = -1                                    # and one not guessed
    assert d.knows_all(keys, wrong)
    assert d.rows(keys).tolist() == rows.tolist()    # the rows noted are the right ones
    assert not d.knows_all([key(1), key(99)], np.array([rows[1], rows[2]]))
    d.add(key(99), hold=False)
    assert d.knows_all([key(1), key(99)], np.array([rows[1], -1]))


def test_a_block_on_its_way_counts_as_stored() -> None:
    loop = asyncio.new_event_loop()
    try:
        d = Directory()
        d.add(key(0), hold=False).copies["nvme"] = 0
        d.add(key(1), hold=False)                      # no copy yet ...
        d.arrive([key(1)], "cpu", loop.create_future())  # ... one on its way
        d.add(key(2), hold=False)                      # neither
        rows, stored = d.stored([key(0), key(1), key(2), key(3)])
        assert stored.tolist() == [True, True, False, False] and rows[3] == -1
        d.hold_rows(rows[stored])
        d.hold_rows(rows[:1])
        assert [d.get(key(i)).holders for i in range(3)] == [2, 1, 0]
        d.let_go([key(0), key(1), key(1), key(2), key(3)])
        assert [d.get(key(i)).holders for i in range(3)] == [1, 0, 0]
    finally:
        loop.close()


def test_a_million_blocks_take_tens_of_bytes_each() -> None:
    d = Directory()
    n = 1_000_000
    digests = np.random.default_rng(2).integers(0, 1 << 63, (n, 2), dtype=np.uint64).tobytes()
    keys = [BlockKey(digests[i * 16:(i + 1) * 16]) for i in range(n)]
    d.add_copies(keys, "nvme", range(n))
    assert len(d) == n and d.nbytes() / n < 64
    assert d.find([keys[123_456]], ["cpu", "nvme"]) == [("nvme", 123_456)]
