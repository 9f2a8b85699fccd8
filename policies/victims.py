"""Victim selection shared by the strategies: skip protected keys, take n or none."""
from __future__ import annotations

from collections.abc import Container, Hashable, Iterable
from itertools import compress, islice


def check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"n={n}: cannot evict a negative number of keys")


def first_unprotected(
    keys: Iterable[Hashable], n: int, protected: Container[Hashable]
) -> list[Hashable] | None:
    """The first ``n`` of ``keys`` outside ``protected``, or None when fewer exist.

    Costs O(n + protected keys passed over); reads ``keys`` only. A ``protected`` with a ``screen(keys)
    -> list[bool]`` method (the tier manager's, which looks keys up in arrays) is asked about the
    candidates in batches of about ``n`` instead of one by one.
    """
    check_count(n)
    screen = getattr(protected, "screen", None)
    if screen is None:
        found = list(islice((key for key in keys if key not in protected), n))
        return found if len(found) == n else None
    found, candidates = [], iter(keys)
    while len(found) < n:
        batch = list(islice(candidates, max(n - len(found), 8)))
        if not batch:
            return None
        found += compress(batch, [not hit for hit in screen(batch)])
    return found[:n]
