"""First in, first out: insertion order alone; use changes nothing."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from dataclasses import dataclass, field

from policies.capacity import validate_capacity
from policies.registry import register
from policies.victims import first_unprotected


@register("fifo")
@dataclass(slots=True, eq=False)
class FIFOPolicy:
    capacity: int | None = None  # accepted like every built-in; FIFO needs no size
    # OrderedDict, not dict: a dict scans the holes that front deletions leave.
    _order: OrderedDict[Hashable, None] = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_capacity(self.capacity)

    def insert(self, key: Hashable) -> None:
        self._order.setdefault(key, None)  # a key already queued keeps its place

    def touch(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        victims = first_unprotected(self._order, n, protected)
        for key in victims or ():
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)
