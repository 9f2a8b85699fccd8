"""KeyTable: block keys in numpy arrays, found one by one and in bulk, through removals and rebuilds."""
from __future__ import annotations

import os
import random

import numpy as np

from tierkv.keytable import KeyTable, split


def test_keys_found_one_by_one_and_in_bulk_through_removals_and_rebuilds() -> None:
    rng = random.Random(3)
    keys = [os.urandom(16) for _ in range(20_000)]
    keys += [i.to_bytes(16, "little") for i in range(3000)] + [bytes([i]) * 16 for i in range(256)]  # patterned
    keys = list(dict.fromkeys(keys))
    table, expected = KeyTable(), {}
    for i, key in enumerate(keys[:500]):                # one at a time, then the rest in bulk
        table.add(key, i)
        expected[key] = i
    table.add_many(split(keys[500:]), np.arange(500, len(keys)))
    expected.update((key, i) for i, key in enumerate(keys) if i >= 500)
    for _ in range(3):                                   # remove a third, add some back under new ids
        for key in rng.sample(sorted(expected), len(expected) // 3):
            table.remove(expected.pop(key))
        spare = iter(sorted(set(range(2 * len(keys))) - set(expected.values())))
        for key in keys:
            if key not in expected and rng.random() < 0.5:
                expected[key] = next(spare)
                table.add(key, expected[key])
    absent = [os.urandom(16) for _ in range(100)]
    assert len(table) == len(expected)
    assert [table.find(key) for key in keys + absent] == [expected.get(key, -1) for key in keys + absent]
    assert table.find_many(keys + absent).tolist() == [expected.get(key, -1) for key in keys + absent]
    assert sorted(table.ids().tolist()) == sorted(expected.values())
    assert all(table.key(i) == key for key, i in expected.items())
    assert table.find_many([]).tolist() == [] and KeyTable().find(keys[0]) == -1


def test_a_million_keys_cost_tens_of_bytes_each() -> None:
    n = 1_000_000
    halves = np.random.default_rng(1).integers(0, 1 << 63, (n, 2), dtype=np.uint64)
    table = KeyTable(n)
    table.add_many(halves, np.arange(n))
    assert table.nbytes() / n <= 16 + 1 + 4 / 0.3 + 0.01   # key, live flag, cells 30 % full
    assert table.find(halves[777].tobytes()) == 777


def test_probes_from_the_last_cells_wrap_to_the_first() -> None:
    """The table is no power of two (its keys' first cells are scaled, not masked): a probe that runs
    off its end goes on at cell 0, in lookups (one by one and in numpy passes), adds and removals."""
    table = KeyTable()
    candidates = np.random.default_rng(2).integers(0, 1 << 63, (200_000, 2), dtype=np.uint64)
    size = len(table._cells)
    at_end = candidates[table._home(candidates) >= size - 2][:40]     # all probe from the last two cells
    assert len(at_end) == 40
    keys = [row.tobytes() for row in at_end]
    for i, key in enumerate(keys[:20]):
        table.add(key, i)
    table.add_many(at_end[20:], np.arange(20, 40))
    assert (table._cells[:30] > 0).all()                               # the run went on at cell 0
    assert [table.find(key) for key in keys] == list(range(40)) == table.find_many(keys).tolist()
    table.remove(3)
    assert table.find(keys[3]) == -1 and [table.find(k) for k in keys[4:]] == list(range(4, 40))
    assert table.find_many(split(keys)).tolist() == [0, 1, 2, -1, *range(4, 40)]


def test_a_remembered_batch_lookup_never_outlives_a_change() -> None:
    keys = [os.urandom(16) for _ in range(40)]
    table = KeyTable()
    table.add_many(split(keys), np.arange(40))
    first = table.find_many(keys)
    first[:] = -7                                     # a caller's copy: the table's memory is untouched
    assert table.find_many(keys).tolist() == list(range(40))
    table.remove(5)
    assert table.find_many(keys)[5] == -1
    table.add(keys[5], 77)
    assert table.find_many(keys)[5] == 77 and table.find_many(list(keys)).tolist() == table.find_many(keys).tolist()


def test_a_lookup_that_must_not_remember_leaves_the_memories_as_they_were() -> None:
    """Another thread's lookup (``remember=False``) reads what the table remembers and writes nothing:
    an answer it wrote while the owner removed its key would outlive the removal."""
    keys = [os.urandom(16) for _ in range(100)]
    table = KeyTable()
    table.add_many(split(keys), np.arange(100))
    assert table.find_many(keys[:50]).tolist() == list(range(50))        # the owner's: remembered
    hot, recent = dict(table._hot), list(table._recent)
    for batch in (keys[40:90], keys[60:65], keys[:50]):
        assert table.find_many(batch, remember=False).tolist() == [keys.index(k) for k in batch]
    assert table._hot == hot and table._recent == recent
    table.note(keys[:5], np.arange(5))                                  # too few to be asked from memory
    assert table._recent == recent


def test_keys_found_lately_stay_exact_through_removals_and_reused_ids(monkeypatch) -> None:
    """Lookups are remembered per key (a dict beside the arrays): a key removed and its id given to
    another key must never be found under that id again, one by one or in a batch."""
    monkeypatch.setattr("tierkv.keytable._HOT_KEYS", 700)     # the memory fills and starts again too
    rng = random.Random(11)
    keys = [os.urandom(16) for _ in range(3000)]
    table = KeyTable()
    table.add_many(split(keys[:2000]), np.arange(2000))
    expected = {key: i for i, key in enumerate(keys[:2000])}
    for _ in range(6):
        for _ in range(20):        # remember many of them, in batches of many sizes and one by one
            batch = rng.sample(keys, rng.randrange(12, 600))
            assert table.find_many(batch).tolist() == [expected.get(k, -1) for k in batch]
            single = rng.choice(keys)
            assert table.find(single) == expected.get(single, -1)
        gone = rng.sample(sorted(expected), 300)
        freed = [expected.pop(key) for key in gone]
        for i in freed:
            table.remove(i)
        newcomers = [k for k in keys if k not in expected and k not in gone][:300]
        for key, i in zip(newcomers, freed):      # the freed ids go to other keys at once
            table.add(key, i)
            expected[key] = i
    assert table.find_many(keys).tolist() == [expected.get(k, -1) for k in keys]
    assert [table.find(k) for k in keys] == [expected.get(k, -1) for k in keys]
