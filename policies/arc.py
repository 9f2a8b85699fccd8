"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), with the manager choosing when to evict.

Four LRU lists, oldest first; a key is in exactly one of them::

    resident  T1: used once since it arrived    T2: used again since
    ghosts    B1: keys evicted from T1          B2: keys evicted from T2
    bounds    |T1| + |B1| <= c                   |T1| + |T2| + |B1| + |B2| <= 2c

Eviction takes from T1 while T1 is larger than the target ``target_t1``
(ARC's p), else from T2. A key inserted again while still a ghost shows
which list evicted too eagerly: a B1 hit raises the target, a B2 hit lowers
it, and the key comes back straight into T2. A one-time scan only ever
passes through T1, so it cannot flush the reused keys in T2.

Here the manager decides when to evict, so the choice cannot look at the
key being admitted (the classic ``x in B2`` tie-break): ties go to T2.
Protected keys are skipped; when the preferred list has nothing left to
give, the other list gives instead.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterator
from dataclasses import dataclass, field

from policies.capacity import Capacity
from policies.registry import register
from policies.victims import check_count

_Keys = OrderedDict[Hashable, None]


def _unprotected(keys: _Keys, protected: Container[Hashable]) -> Iterator[Hashable]:
    return (key for key in keys if key not in protected)


def _drop_oldest(keys: _Keys, count: int) -> None:
    for _ in range(count):
        keys.popitem(last=False)


@register("arc")
@dataclass(slots=True, eq=False)
class ARCPolicy:
    capacity: int | None = None  # c in blocks; None: the most keys ever resident
    target_t1: float = field(default=0.0, init=False)  # ARC's p, in [0, c]
    _size: Capacity = field(init=False, repr=False)
    _t1: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _t2: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _b1: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _b2: _Keys = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._size = Capacity(self.capacity)

    def insert(self, key: Hashable) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            self._adapt(+max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._adapt(-max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._size.observe(len(self))
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        check_count(n)
        chosen = self._choose(n, protected)
        if chosen is None:
            return None
        for key, from_t1 in chosen:
            self._demote(key, from_t1)  # moves keep both ghost bounds: only inserts trim
        return [key for key, _ in chosen]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def _choose(self, n: int, protected: Container[Hashable]) -> list[tuple[Hashable, bool]] | None:
        """``n`` (key, came from T1) pairs in ARC order, reading the lists only."""
        sources = {True: _unprotected(self._t1, protected), False: _unprotected(self._t2, protected)}
        t1_left = len(self._t1)
        chosen: list[tuple[Hashable, bool]] = []
        while len(chosen) < n:
            from_t1 = t1_left > self.target_t1
            key = next(sources[from_t1], None)
            if key is None:
                from_t1 = not from_t1
                key = next(sources[from_t1], None)
            if key is None:
                return None
            if from_t1:
                t1_left -= 1
            chosen.append((key, from_t1))
        return chosen

    def _demote(self, key: Hashable, from_t1: bool) -> None:
        resident, ghosts = (self._t1, self._b1) if from_t1 else (self._t2, self._b2)
        del resident[key]
        ghosts[key] = None

    def _adapt(self, step: float) -> None:
        self.target_t1 = min(max(self.target_t1 + step, 0.0), float(self._size.blocks))

    def _trim_ghosts(self) -> None:
        c = self._size.blocks
        _drop_oldest(self._b1, len(self._b1) - max(0, c - len(self._t1)))
        _drop_oldest(self._b2, len(self._b2) - max(0, 2 * c - len(self) - len(self._b1)))
