"""Least recently used over the directory's rows: the NVMe store's eviction order in one int32 column.

A store holds every block of a long document (a million pages at 1M tokens);
`policies.lru`'s OrderedDict keeps ~165 bytes a block for that order (its
entries and the key objects they hold). Here the order is a stamp per
directory row, 4 bytes a block::

    insert      stamp = ++clock          (most recent last out)
    insert_cold stamp = -(++cold)        (first out, the newest guess first)
    touch       stamp = ++clock          (only of a block it knows: stamp != 0)
    remove      stamp = 0
    evict(n)    the n smallest stamps outside ``protected``, oldest first

A clock about to pass what an int32 holds (two billion stamps: ~34 hours of a
1M-token decode touching 17,600 pages a step at 1 tok/s) first renumbers the
stamps by rank, 1..n and -m..-1, in the same order: the choices stay the same.

It chooses exactly what `LRUPolicy` chooses (tests/manager/test_array_lru.py runs
both on the same histories). An eviction ranks the stamped rows (argpartition
over the store's blocks, ~10 ms at a million), which a store pays only when full;
memory tiers, which evict on most loads, keep `LRUPolicy`.
"""
from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Sequence

import numpy as np

from policies.victims import check_count
from tierkv.keys import BlockKey
from tierkv.manager.directory import Directory

STAMP_LIMIT = np.iinfo(np.int32).max   # the clocks renumber the stamps before they pass this


class ArrayLRU:
    registered_as = "lru"   # what a recorded trace names it: a replay makes the plain LRU (same victims)

    def __init__(self, directory: Directory, name: str) -> None:
        self._directory, self._name = directory, name
        self._clock = 0
        self._cold = 0

    def insert(self, key: Hashable) -> None:
        self._stamp(key, recent=True)

    def insert_many(self, keys: Sequence[Hashable]) -> None:
        rows = self._directory.find_rows(keys)
        if len(rows) and rows.min() < 0:
            self._stamp(keys[int(np.argmin(rows))], recent=True)   # raises, naming the key
        stamps = self._advance(len(rows))
        np.maximum.at(stamps, rows, self._next(len(rows)))   # a repeated key: its last

    def insert_cold(self, key: Hashable) -> None:
        """A guessed block (a speculative prefetch): first in line for eviction until a reader uses it."""
        self._stamp(key, recent=False)

    def touch(self, key: Hashable) -> None:
        row = self._row(key)
        if row >= 0 and self._directory.order(self._name)[row]:
            stamps = self._advance(1)
            self._clock += 1
            stamps[row] = self._clock

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        keys = list(keys)
        rows = self._directory.find_rows(keys)
        stamps = self._directory.order(self._name)
        rows = rows[rows >= 0]
        rows = rows[stamps[rows] != 0]
        if len(rows):   # in order: a key touched twice ends with the later stamp
            np.maximum.at(self._advance(len(rows)), rows, self._next(len(rows)))

    def remove(self, key: Hashable) -> None:
        row = self._row(key)
        if row >= 0:
            self._directory.order(self._name)[row] = 0

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        check_count(n)
        stamps = self._directory.order(self._name)
        rows = np.flatnonzero(stamps)
        victims: list[Hashable] = []
        taken: list[int] = []
        ranked = 0
        while len(victims) < n and ranked < len(rows):
            more = min(len(rows), max(2 * ranked, n + 64))   # rank a few more than asked; more if protected
            part = rows[np.argpartition(stamps[rows], more - 1)[:more]] if more < len(rows) else rows
            part = part[np.argsort(stamps[part], kind="stable")][ranked:].tolist()
            keys = [self._directory.key_of(row) for row in part]
            screen = getattr(protected, "screen", None)   # the manager's guard answers a batch at once
            kept = screen(keys) if screen is not None else [key in protected for key in keys]
            for row, key, keep in zip(part, keys, kept):
                if not keep:
                    victims.append(key)
                    taken.append(row)
                    if len(victims) == n:
                        break
            ranked = more
        if len(victims) < n:
            return None
        stamps[taken] = 0
        return victims

    def __len__(self) -> int:
        return int(np.count_nonzero(self._directory.order(self._name)))

    def _row(self, key: Hashable) -> int:
        return self._directory.find_row(key) if isinstance(key, BlockKey) else -1

    def _stamp(self, key: Hashable, *, recent: bool) -> None:
        row = self._row(key)
        if row < 0:
            raise KeyError(f"{key!r}: not in the directory; the store's LRU orders the directory's blocks")
        stamps = self._advance(1, cold=not recent)
        if recent:
            self._clock += 1
            stamps[row] = self._clock
        else:
            self._cold += 1
            stamps[row] = -self._cold

    def _advance(self, n: int, *, cold: bool = False) -> np.ndarray:
        """The stamp column, renumbered first if ``n`` more stamps of a clock would pass STAMP_LIMIT."""
        stamps = self._directory.order(self._name)
        if (self._cold if cold else self._clock) + n > STAMP_LIMIT:
            recent, old = np.flatnonzero(stamps > 0), np.flatnonzero(stamps < 0)
            stamps[recent[np.argsort(stamps[recent], kind="stable")]] = np.arange(1, len(recent) + 1)
            stamps[old[np.argsort(stamps[old], kind="stable")]] = -np.arange(len(old), 0, -1)
            self._clock, self._cold = len(recent), len(old)
            if (self._cold if cold else self._clock) + n > STAMP_LIMIT:
                raise OverflowError(f"{n} stamps at once past {STAMP_LIMIT} ordered blocks")
        return stamps

    def _next(self, n: int) -> np.ndarray:
        """The clock's next ``n`` stamps (after `_advance`), in order, as the clock moves past them."""
        first, self._clock = self._clock + 1, self._clock + n
        return np.arange(first, first + n, dtype=np.int32)
