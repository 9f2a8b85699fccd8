"""Protocols that strategies in the top-level ``policies`` package implement.

Policies rank, the manager acts: a policy sees only keys, never bytes or
tiers. One eviction policy instance serves one tier.

``evict(n, protected)`` returns ``n`` victims, none of them in ``protected``,
and forgets them; when it cannot find ``n`` it returns ``None`` and changes
nothing.
"""
from __future__ import annotations

from collections.abc import Container, Hashable
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None:
        """A block became resident in the tier."""

    def touch(self, key: Hashable) -> None:
        """A resident block was used."""

    def remove(self, key: Hashable) -> None:
        """A block left the tier for a reason other than ``evict``."""

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        """Choose and forget ``n`` victims outside ``protected``, or return None."""

    def __len__(self) -> int: ...
