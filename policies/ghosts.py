"""What a policy remembers of the keys it evicted: a value per key (H2O's score, lfu-history's
count), at most ``per_block`` per block of the tier's capacity, the oldest forgotten first.

Without a configured capacity the bound follows the most keys the policy has
held at once (`Capacity`), which the policy reports through ``resident``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from policies.capacity import Capacity
from tierkv.errors import ConfigError

V = TypeVar("V")


class Ghosts(Generic[V]):
    __slots__ = ("per_block", "size", "_values")

    def __init__(self, capacity: int | None, per_block: int) -> None:
        if isinstance(per_block, bool) or not isinstance(per_block, int) or per_block < 0:
            raise ConfigError(f"ghosts_per_block={per_block!r}: expected an integer >= 0")
        self.per_block, self.size = per_block, Capacity(capacity)
        self._values: OrderedDict[Hashable, V] = OrderedDict()

    def resident(self, keys: int) -> None:
        """The policy holds ``keys`` keys now."""
        self.size.observe(keys)

    def remember(self, key: Hashable, value: V) -> None:
        """Keep ``value`` for ``key`` as the newest ghost, forgetting the oldest past the bound."""
        self._values.pop(key, None)
        self._values[key] = value
        for _ in range(len(self._values) - self.per_block * self.size.blocks):
            self._values.popitem(last=False)

    def take(self, key: Hashable, default: V) -> V:
        """``key``'s value, forgotten here (the key is back in the tier)."""
        return self._values.pop(key, default)

    def get(self, key: Hashable, default: V) -> V:
        return self._values.get(key, default)

    def forget(self, key: Hashable) -> None:
        self._values.pop(key, None)

    def __len__(self) -> int:
        return len(self._values)
