"""Every transfer and every wait is an event.

An event carries its kind, the tier pair, the layer, the bytes and three
monotonic timestamps (``time.perf_counter``): submitted, started, done. A
wait's ``start`` is when the caller began waiting, ``done`` when it resumed;
stall = time compute waited on a transfer. Recording is an append to a list
(atomic under the GIL), cheap enough to leave on.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Event:
    kind: str            # transfers: put | load | prefetch | demote | writeback
                         # caller side: wait (stall) | hit (blocks found in place, src = dst = tier)
                         # compute: step (decode step) | prefill | layer (one decoder layer)
    src: str             # tier name, "" for none
    dst: str
    layer: int | None
    nbytes: int
    submit: float
    start: float
    done: float
    blocks: int = 1
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.done - self.start

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class EventRecorder:
    """Collects events; ``enabled=False`` makes recording a no-op."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.events: list[Event] = []
        self.origin = time.perf_counter()

    def record(self, event: Event) -> None:
        if self.enabled:
            self.events.append(event)

    def wait(self, src: str, dst: str, layer: int | None, nbytes: int, start: float, blocks: int = 1) -> None:
        now = time.perf_counter()
        self.record(Event("wait", src, dst, layer, nbytes, start, start, now, blocks))

    def clear(self) -> None:
        self.events.clear()

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``spans`` (start, done) was running; overlaps count once."""
    total, reach = 0.0, float("-inf")
    for start, done in sorted(spans):
        if done > reach:
            total += done - max(start, reach)
            reach = done
    return total
