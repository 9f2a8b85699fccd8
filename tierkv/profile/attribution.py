"""Stall attribution: which tier links a reader's wait was blocked behind.

A wait names the tier it read into, not what it waited for. Its time is split
over the transfers that overlapped it, in proportion to how much of the wait
each tier link's transfers covered: loads and prefetches into that tier for
the same layer (the blocks it waited for) and demotes out of that tier (room
being made). When nothing of that layer overlapped, loads and prefetches into
the tier for any layer count. A wait that names its source (``src``) is
charged to that link whole; one that nothing overlapped is charged to
"unattributed".
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence

from tierkv.events import Event, EventKind, busy_seconds

INTO_MEMORY = ("load", "prefetch")
UNATTRIBUTED = "unattributed"


class TransferIndex:
    """Transfers a wait may overlap, indexed by what they bring in (dst, layer) and what they evict."""

    def __init__(self, events: Sequence[Event]) -> None:
        into: dict[tuple[str, int | None], list[Event]] = defaultdict(list)
        into_any: dict[str, list[Event]] = defaultdict(list)
        out_of: dict[str, list[Event]] = defaultdict(list)
        for e in events:
            if e.kind in INTO_MEMORY:
                into[(e.dst, e.layer)].append(e)
                into_any[e.dst].append(e)
            elif e.kind == EventKind.DEMOTE:
                out_of[e.src].append(e)
        self.into = {k: _Overlaps(v) for k, v in into.items()}
        self.into_any = {k: _Overlaps(v) for k, v in into_any.items()}
        self.out_of = {k: _Overlaps(v) for k, v in out_of.items()}

    def blockers(self, w: Event) -> list[Event]:
        found = _find(self.into.get((w.dst, w.layer)), w) + _find(self.out_of.get(w.dst), w)
        return found or _find(self.into_any.get(w.dst), w)


def _find(index: _Overlaps | None, w: Event) -> list[Event]:
    return [] if index is None else index.find(w.start, w.done)


class _Overlaps:
    def __init__(self, events: list[Event]) -> None:
        self.events = sorted(events, key=lambda e: e.start)
        self.starts = [e.start for e in self.events]
        self.longest = max((e.done - e.start for e in self.events), default=0.0)

    def find(self, start: float, done: float) -> list[Event]:
        hi = bisect.bisect_left(self.starts, done)
        lo = bisect.bisect_left(self.starts, start - self.longest)
        return [e for e in self.events[lo:hi] if e.done > start]


def attribute(wait: Event, transfers: TransferIndex) -> dict[tuple[str, str], float]:
    """Seconds of ``wait`` per (link, kind) it was blocked behind (see the module doc)."""
    seconds = wait.done - wait.start
    if wait.src:
        return {(f"{wait.src}->{wait.dst}", "load"): seconds}
    covered: dict[tuple[str, str], float] = {}
    by_key: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for e in transfers.blockers(wait):
        by_key[(f"{e.src}->{e.dst}", e.kind)].append((max(e.start, wait.start), min(e.done, wait.done)))
    for key, spans in by_key.items():
        covered[key] = busy_seconds(spans)
    total = sum(covered.values())
    if total <= 0:
        return {(UNATTRIBUTED, ""): seconds}
    return {key: seconds * c / total for key, c in covered.items() if c > 0}
