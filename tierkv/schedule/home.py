"""Static homes in the tier manager: the eviction policy that keeps a policy's placement in place.

A FlexGen policy fixes where each weight tensor and KV block lives (its *home*). The schedule
reads every block once per token step, in the same order: a cyclic scan, which LRU answers with
a miss every time. So the batch runner gives each memory tier this policy instead::

    home keys      put into the tier as their home; never chosen as victims
    staged copies  blocks whose home is disk, loaded for one use; least recently used go first

The policy ranks, the manager acts: it sees only keys, and the runner tells it which keys are
homes (``homes`` is shared with the stores that put the blocks).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class HomePolicy:
    homes: set[Hashable] = field(default_factory=set)
    _staged: OrderedDict[Hashable, None] = field(default_factory=OrderedDict, init=False, repr=False)
    _resident: set[Hashable] = field(default_factory=set, init=False, repr=False)

    def insert(self, key: Hashable) -> None:
        self._resident.add(key)
        if key not in self.homes:
            self._staged[key] = None
            self._staged.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._staged:
            self._staged.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._resident.discard(key)
        self._staged.pop(key, None)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        victims = [k for k in self._staged if k not in protected][:n]
        if len(victims) < n:
            return None
        for key in victims:
            self.remove(key)
        return victims

    def __len__(self) -> int:
        return len(self._resident)
