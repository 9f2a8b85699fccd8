"""Victim selection shared by the strategies: skip protected keys, take n or none."""
from __future__ import annotations

from collections.abc import Container, Hashable, Iterable
from itertools import islice


def check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"n={n}: cannot evict a negative number of keys")


def first_unprotected(
    keys: Iterable[Hashable], n: int, protected: Container[Hashable]
) -> list[Hashable] | None:
    """The first ``n`` of ``keys`` outside ``protected``, or None when fewer exist.

    Costs O(n + protected keys passed over); reads ``keys`` only.
    """
    check_count(n)
    found = list(islice((key for key in keys if key not in protected), n))
    return found if len(found) == n else None
