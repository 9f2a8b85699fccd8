"""One block pool for every tier: slots, a free list, pin counts and states.

A slot moves through explicit states; a pinned slot can neither be freed nor
reused::

    FREE --reserve()--> RESERVED --commit()--> READY --release()--> FREE
                           |                      ^ pin()/unpin() count readers
                           +------release()-------+-> FREE  (a transfer failed)

The pool holds no bytes, does no I/O and knows no policy. Records exist only
for slots in use, so a pool of millions of slots costs nothing up front.
Lowest free slot first: files and arenas stay compact.
"""
from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from tierkv.errors import BudgetExceeded


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"  # destination of a transfer in flight
    READY = "ready"        # holds a complete block


@dataclass(slots=True)
class _Slot:
    state: SlotState
    pins: int = 0


_STATE = attrgetter("state")


class BlockPool:
    """Slot bookkeeping for ``capacity`` fixed-size slots."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity}: must be >= 0")
        self.capacity = capacity
        self._slots: dict[int, _Slot] = {}
        self._freed: list[int] = []   # heap of released slots below _next
        self._next = 0                # slots >= _next were never used

    # -- queries ---------------------------------------------------------
    def state(self, slot: int) -> SlotState:
        record = self._slots.get(slot)
        return SlotState.FREE if record is None else record.state

    def pins(self, slot: int) -> int:
        record = self._slots.get(slot)
        return 0 if record is None else record.pins

    @property
    def used(self) -> int:
        return len(self._slots)

    @property
    def free(self) -> int:
        return self.capacity - len(self._slots)

    def busy_slots(self) -> int:
        """Slots that are pinned or reserved: room that a reader or a transfer will give back."""
        return sum(1 for r in self._slots.values() if r.pins or r.state is SlotState.RESERVED)

    def can_reserve(self, n: int = 1) -> bool:
        return self.free >= n

    # -- transitions -----------------------------------------------------
    def reserve(self) -> int:
        if not self.can_reserve():
            raise BudgetExceeded(f"block pool full ({self.capacity} slots)")
        slot = heapq.heappop(self._freed) if self._freed else self._take_new()
        self._track(slot, SlotState.RESERVED)
        return slot

    def reserve_many(self, n: int) -> list[int]:
        """``n`` slots at once, lowest first (all or none)."""
        if not self.can_reserve(n):
            raise BudgetExceeded(f"block pool full ({self.capacity} slots, {self.free} free, {n} asked)")
        freed = self._freed
        slots = [heapq.heappop(freed) for _ in range(min(n, len(freed)))]
        if len(slots) < n:
            first = self._next
            self._next += n - len(slots)
            slots.extend(range(first, self._next))
        for slot in slots:
            self._track(slot, SlotState.RESERVED)
        return slots

    def restore(self, slots: list[int]) -> None:
        """Mark these slots READY in an unused pool (reopening a store that holds them)."""
        if self._slots or self._next:
            raise ValueError("restore needs a pool that has not been used yet")
        ready = set(slots)
        bad = [s for s in ready if not 0 <= s < self.capacity]
        if bad:
            raise ValueError(f"slot={bad[0]}: outside 0..{self.capacity - 1}")
        self._next = max(ready, default=-1) + 1
        self._freed = [s for s in range(self._next) if s not in ready]  # ascending: already a heap
        self._slots = {s: _Slot(SlotState.READY) for s in sorted(ready)}

    def commit(self, slot: int) -> None:
        record = self._record(slot, SlotState.RESERVED)
        record.state = SlotState.READY

    def pin(self, slot: int) -> None:
        self._record(slot, SlotState.READY).pins += 1

    def unpin(self, slot: int) -> None:
        record = self._record(slot, SlotState.READY)
        if record.pins == 0:
            raise ValueError(f"slot={slot}: unpin without pin")
        record.pins -= 1

    # -- the same, for many slots at once (the load path moves hundreds a call) --
    def commit_many(self, slots: Sequence[int]) -> None:
        for record in self._records_in(slots, SlotState.RESERVED):
            record.state = SlotState.READY

    def pin_many(self, slots: Sequence[int]) -> None:
        for record in self._records_in(slots, SlotState.READY):
            record.pins += 1

    def unpin_many(self, slots: Sequence[int]) -> None:
        records = self._records_in(slots, SlotState.READY)
        for record in records:
            record.pins -= 1
        if any(record.pins < 0 for record in records):   # more unpins than pins (a slot may repeat)
            slot = next(s for s, r in zip(slots, records) if r.pins < 0)
            for record in records:
                record.pins += 1
            raise ValueError(f"slot={slot}: unpin without pin")

    def release_many(self, slots: Sequence[int]) -> None:
        get, forget = self._slots.get, self._forget
        for slot in slots:
            record = get(slot)
            if record is None or record.pins:
                self.release(slot)   # raises, naming the slot
            forget(slot)

    def release(self, slot: int) -> None:
        record = self._slots.get(slot)
        if record is None:
            raise ValueError(f"slot={slot}: already free")
        if record.pins:
            raise ValueError(f"slot={slot}: still pinned {record.pins} time(s)")
        self._forget(slot)

    # -- internals -------------------------------------------------------
    def _track(self, slot: int, state: SlotState) -> None:
        """Keep a record for ``slot`` (a subclass that counts records hooks in here)."""
        self._slots[slot] = _Slot(state)

    def _forget(self, slot: int) -> None:
        """Drop ``slot``'s record: it is free to reserve again."""
        del self._slots[slot]
        heapq.heappush(self._freed, slot)

    def _take_new(self) -> int:
        slot = self._next
        self._next += 1
        return slot

    def _records_in(self, slots: Sequence[int], expected: SlotState) -> list[_Slot]:
        """The records of ``slots``, each checked to be in ``expected`` state before any changes."""
        records = list(map(self._slots.get, slots))
        if not all(records) or not {*map(_STATE, records)} <= {expected}:   # C-level passes, no __eq__
            for slot in slots:
                self._record(slot, expected)   # raises, naming the first slot in another state
        return records  # type: ignore[return-value]

    def _record(self, slot: int, expected: SlotState) -> _Slot:
        record = self._slots.get(slot)
        state = SlotState.FREE if record is None else record.state
        if state is not expected:
            raise ValueError(f"slot={slot}: is {state.value}, expected {expected.value}")
        return record  # type: ignore[return-value]
