"""Heavy-Hitter Oracle (H2O, Zhang et al., NeurIPS 2023): evict the block attention uses least.

Each block's score is the attention mass it has accumulated, reported by the
reader through ``observe(key, score)`` (see ``tierkv.policy``). Eviction
takes the lowest score first, the least recently used among equal scores,
so without any scores this is LRU.

Scores describe the block, not its copy in this tier: an evicted block keeps
its score as a ghost and gets it back when it returns, and ``observe`` of a
block resident elsewhere is remembered too. Ghosts are bounded (the oldest
go first); ``remove`` (the block is gone) forgets the score.

Ranks live in a heap of ``(score, last use, serial, key)``; every use or
score pushes a fresh entry and the key's old one goes stale (skipped when
met, dropped when the heap grows past twice the live entries). ``evict`` pops; the protected
entries it passes over, and everything when it fails, are pushed back.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Container, Hashable
from dataclasses import dataclass, field
from itertools import count

from policies.ghosts import Ghosts
from policies.registry import register
from policies.victims import check_count

_Entry = tuple[float, int, int, Hashable]  # serials are unique, so keys are never compared


@register("h2o")
@dataclass(slots=True, eq=False)
class H2OPolicy:
    capacity: int | None = None   # sizes the ghost scores; None: the most keys ever resident
    ghosts_per_block: int = 4     # ghost scores kept per block of capacity
    _rank: dict[Hashable, _Entry] = field(default_factory=dict, init=False, repr=False)  # live entries
    _ghosts: Ghosts[float] = field(init=False, repr=False)
    _heap: list[_Entry] = field(default_factory=list, init=False, repr=False)
    _serials: count = field(default_factory=count, init=False, repr=False)

    def __post_init__(self) -> None:
        self._ghosts = Ghosts(self.capacity, self.ghosts_per_block)

    def insert(self, key: Hashable) -> None:
        score = self._rank[key][0] if key in self._rank else self._ghosts.take(key, 0.0)
        self._rerank(key, score)
        self._ghosts.resident(len(self))

    def touch(self, key: Hashable) -> None:
        if key in self._rank:
            self._rerank(key, self._rank[key][0])

    def observe(self, key: Hashable, score: float) -> None:
        if not math.isfinite(score):
            raise ValueError(f"score={score!r} for {key!r}: must be a finite number")
        if key in self._rank:
            held, last_use, _, _ = self._rank[key]
            self._push(key, held + score, last_use)
            return
        self._ghosts.remember(key, self._ghosts.take(key, 0.0) + score)

    def remove(self, key: Hashable) -> None:
        self._rank.pop(key, None)
        self._ghosts.forget(key)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        check_count(n)
        victims: list[_Entry] = []
        passed: list[_Entry] = []
        while len(victims) < n and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._live(entry):
                continue
            (passed if entry[3] in protected else victims).append(entry)
        if len(victims) < n:
            passed += victims
            victims = []
        for entry in passed:
            heapq.heappush(self._heap, entry)
        if len(victims) < n:
            return None
        for score, _, _, key in victims:
            del self._rank[key]
            self._ghosts.remember(key, score)
        return [entry[3] for entry in victims]

    def score(self, key: Hashable) -> float:
        """The accumulated score of a resident or remembered block (0 when unknown)."""
        return self._rank[key][0] if key in self._rank else self._ghosts.get(key, 0.0)

    def __len__(self) -> int:
        return len(self._rank)

    def _rerank(self, key: Hashable, score: float) -> None:
        self._push(key, score, next(self._serials))  # a serial is also a point in time

    def _push(self, key: Hashable, score: float, last_use: int) -> None:
        entry = self._rank[key] = (score, last_use, next(self._serials), key)
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._rank) + 32:
            self._heap = list(self._rank.values())
            heapq.heapify(self._heap)

    def _live(self, entry: _Entry) -> bool:
        return self._rank.get(entry[3]) is entry
