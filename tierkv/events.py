"""Every transfer and every wait is an event; and the hook told of every block stored or read.

An event carries its kind, the tier pair, the layer, the bytes and three
monotonic timestamps (``time.perf_counter``): submitted, started, done. A
wait's ``start`` is when the caller began waiting, ``done`` when it resumed;
stall = time compute waited on a transfer. Recording is an append to a list
(atomic under the GIL), cheap enough to leave on.
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from tierkv.keys import BlockKey


class EventKind(str, enum.Enum):
    """What an event is. A ``str`` enum: it compares equal to, and exports as, its value."""

    # transfers (`tierkv.manager.transfer.Kind`, same values)
    PUT = "put"
    LOAD = "load"
    PREFETCH = "prefetch"
    DEMOTE = "demote"
    WRITEBACK = "writeback"
    # the caller's side
    WAIT = "wait"            # compute waited on a transfer (stall)
    HIT = "hit"              # blocks found in place (src = dst = tier)
    # compute
    STEP = "step"            # one decode step
    PREFILL = "prefill"
    LAYER = "layer"          # one decoder layer
    # a simulated CXL pool (`tierkv.tiers.cxl_link`, `cxl_pnm`)
    LINK = "link"            # bytes on the link
    QUEUE = "queue"          # waiting for a channel or the processor
    COMPUTE = "compute"      # the near-memory processor

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:   # hash as the value, so a dict keyed by "wait" finds EventKind.WAIT
        return str.__hash__(self)


COMPUTE_KINDS = (EventKind.PREFILL, EventKind.STEP, EventKind.LAYER)    # the caller's own work
MODELLED_KINDS = (EventKind.LINK, EventKind.QUEUE, EventKind.COMPUTE)   # a simulated CXL pool's slices


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
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
    """Collects events; ``enabled=False`` makes recording a no-op. The seconds each thread waited are
    counted apart, recording or not (`waited`): answers decoded side by side each take their own stall."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.events: list[Event] = []
        self.origin = time.perf_counter()
        self._waited: dict[int, float] = {}     # thread ident -> seconds; each written only while it waits

    def record(self, event: Event) -> None:
        if self.enabled:
            self.events.append(event)

    def wait(self, src: str, dst: str, layer: int | None, nbytes: int, start: float, blocks: int = 1, *,
             thread: int | None = None) -> None:
        """A wait from ``start`` to now, of ``thread`` (its ident; the calling thread's by default)."""
        now = time.perf_counter()
        thread = threading.get_ident() if thread is None else thread
        self._waited[thread] = self._waited.get(thread, 0.0) + (now - start)
        self.record(Event(EventKind.WAIT, src, dst, layer, nbytes, start, start, now, blocks))

    def waited(self) -> float:
        """Seconds the calling thread has waited on transfers, in all (take differences)."""
        return self._waited.get(threading.get_ident(), 0.0)

    def clear(self) -> None:
        self.events.clear()

    def of_kind(self, *kinds: EventKind | str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``spans`` (start, done) was running; overlaps count once."""
    total, reach = 0.0, float("-inf")
    for start, done in sorted(spans):
        if done > reach:
            total += done - max(start, reach)
            reach = done
    return total


class AccessHook(Protocol):
    """Told of every block a caller stores or reads (see tierkv.profile.access).

    A hook may also take ``on_guess(keys, layer, source)``: the blocks a prefetcher (``source``, e.g.
    "speculative") guesses ``layer`` will read, whether or not they are prefetched. The manager never
    calls it; an engine that guesses does, where the hook has it (``getattr(hook, "on_guess", None)``).
    """

    def on_put(self, key: BlockKey, layer: int | None) -> None: ...

    def on_acquire(self, keys: Sequence[BlockKey], layer: int | None) -> None: ...
