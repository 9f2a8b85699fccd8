"""First in, first out: insertion order alone; use changes nothing.

The same ordered queue as LRU, minus the move-to-end on use.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import filterfalse

from policies.lru import LRUPolicy
from policies.registry import register


@register("fifo")
@dataclass(slots=True, eq=False)
class FIFOPolicy(LRUPolicy):
    def insert(self, key: Hashable) -> None:
        self._order.setdefault(key, None)  # a key already queued keeps its place

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        """``insert`` each: the new ones queue in order, those queued already keep their place."""
        order = self._order
        order.update(dict.fromkeys(filterfalse(order.__contains__, keys)))

    def touch(self, key: Hashable) -> None:
        pass

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        pass

    insert_cold = None   # not LRU's: a use could never lift a cold block again (see tierkv.policy.AdmitsCold)
