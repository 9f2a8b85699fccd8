"""Least recently used: one OrderedDict, oldest use first."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Hashable, Iterable
from dataclasses import dataclass, field

from policies.capacity import validate_capacity
from policies.registry import register
from policies.victims import first_unprotected


@register("lru")
@dataclass(slots=True, eq=False)
class LRUPolicy:
    capacity: int | None = None  # accepted like every built-in; LRU needs no size
    _order: OrderedDict[Hashable, None] = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_capacity(self.capacity)

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        """``insert`` each, in order, at C speed (a load admits hundreds at once)."""
        keys = list(keys)
        order = self._order
        before = len(order)
        order.update(dict.fromkeys(keys))
        if len(order) - before < len(keys):   # some were already known (or a key repeats): move them last
            deque(map(order.move_to_end, keys), maxlen=0)

    def insert_cold(self, key: Hashable) -> None:
        """A guessed block (a speculative prefetch): first in line for eviction until a reader uses it."""
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        deque(map(order.move_to_end, filter(order.__contains__, keys)), maxlen=0)   # C speed

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        victims = first_unprotected(self._order, n, protected)
        deque(map(self._order.__delitem__, victims or ()), maxlen=0)   # C speed: a load evicts hundreds
        return victims

    def __len__(self) -> int:
        return len(self._order)
