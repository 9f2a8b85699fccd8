"""One block pool for every tier: slots, a free list, pin counts and states.

A slot moves through explicit states; a pinned slot can neither be freed nor
reused::

    FREE --reserve()--> RESERVED --commit()--> READY --release()--> FREE
                           |                      ^ pin()/unpin() count readers
                           +------release()-------+-> FREE  (a transfer failed)

The pool holds no bytes, does no I/O and knows no policy. States and pin
counts live in two arrays (5 bytes a slot; a memory tier's also counts each
slot's frees, 4 more) that grow to the highest slot in use, so a pool of
millions of slots costs nothing up front, and the load path's batch calls
check and change hundreds of slots in a few vectorised passes.
Lowest free slot first: files and arenas stay compact.
"""
from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence

import numpy as np

from tierkv.errors import BudgetExceeded


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"  # destination of a transfer in flight
    READY = "ready"        # holds a complete block


FREE, RESERVED, READY = 0, 1, 2                                    # codes in the state array
_STATES = (SlotState.FREE, SlotState.RESERVED, SlotState.READY)
_GROW = 4096                                                       # slots the arrays grow by, at least


class BlockPool:
    """Slot bookkeeping for ``capacity`` fixed-size slots; ``generations``: a count a slot of the times
    it was freed, for readers that copy blocks out unpinned (a memory tier's)."""

    def __init__(self, capacity: int, *, generations: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity}: must be >= 0")
        self.capacity = capacity
        self._state = np.zeros(0, np.int8)    # per slot below len: FREE / RESERVED / READY
        self._pins = np.zeros(0, np.int32)    # per slot below len: readers holding it
        self._used = 0                        # slots not FREE
        self.epoch = 0                        # bumped before any slot is freed (see `release_many`)
        self.generations = np.zeros(0, np.uint32) if generations else None   # bumped before a slot is freed
        self._freed: list[int] = []           # heap of released slots below _next
        self._next = 0                        # slots >= _next were never used

    # -- queries ---------------------------------------------------------
    def nbytes(self) -> int:
        """The bytes of the slot arrays (a state, a pin count and, where kept, a generation a slot used
        so far)."""
        generations = 0 if self.generations is None else self.generations.nbytes
        return self._state.nbytes + self._pins.nbytes + generations

    def state(self, slot: int) -> SlotState:
        return _STATES[self._state.item(slot)] if 0 <= slot < len(self._state) else SlotState.FREE

    def pins_of(self, slots: np.ndarray) -> np.ndarray:
        """`pins` of each slot, in one pass."""
        inside = slots < len(self._pins)
        return np.where(inside, self._pins[np.where(inside, slots, 0)] if len(self._pins) else 0, 0)

    def pins(self, slot: int) -> int:
        return self._pins.item(slot) if 0 <= slot < len(self._pins) else 0

    def in_use(self, slot: int) -> bool:
        return 0 <= slot < len(self._state) and self._state.item(slot) != FREE

    def slots_in_use(self) -> list[int]:
        """Every slot that is not FREE, ascending."""
        return np.flatnonzero(self._state).tolist()

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.capacity - self._used

    def busy_slots(self) -> int:
        """Slots that are pinned or reserved: room that a reader or a transfer will give back."""
        return int(np.count_nonzero((self._pins > 0) | (self._state == RESERVED)))

    def can_reserve(self, n: int = 1) -> bool:
        return self.free >= n

    # -- transitions -----------------------------------------------------
    def reserve(self) -> int:
        return self.reserve_many(1)[0]

    def reserve_many(self, n: int) -> list[int]:
        """``n`` slots at once, lowest first (all or none)."""
        if not self.can_reserve(n):
            raise BudgetExceeded(f"block pool full ({self.capacity} slots, {self.free} free, {n} asked)")
        slots = self._lowest_freed(n)
        if len(slots) < n:
            first = self._next
            self._next += n - len(slots)
            slots.extend(range(first, self._next))
        self._take(np.array(slots, np.int64), RESERVED)
        return slots

    def restore(self, slots: list[int]) -> None:
        """Mark these slots READY in an unused pool (reopening a store that holds them)."""
        if self._used or self._next:
            raise ValueError("restore needs a pool that has not been used yet")
        ready = np.unique(self._inside(slots))
        self._next = int(ready[-1]) + 1 if len(ready) else 0
        self._freed = np.setdiff1d(np.arange(self._next), ready, assume_unique=True).tolist()  # ascending: a heap
        self._take(ready, READY)

    def commit(self, slot: int) -> None:
        self._expect(slot, RESERVED)
        self._state[slot] = READY

    def pin(self, slot: int) -> None:
        self._expect(slot, READY)
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._expect(slot, READY)
        if self._pins.item(slot) == 0:
            raise ValueError(f"slot={slot}: unpin without pin")
        self._pins[slot] -= 1

    def release(self, slot: int) -> None:
        self.release_many((slot,))

    # -- the same, for many slots at once (the load path moves hundreds a call) --
    def commit_many(self, slots: Sequence[int]) -> None:
        self._state[self._checked(slots, RESERVED)] = READY

    def pin_many(self, slots: Sequence[int]) -> None:
        at = self._checked(slots, READY)
        if _distinct(slots):
            self._pins[at] += 1       # a slot named once: plain indexing (np.add.at costs ~10 us a call)
        else:
            np.add.at(self._pins, at, 1)

    def unpin_many(self, slots: Sequence[int]) -> None:
        at = self._checked(slots, READY)
        if _distinct(slots):          # the usual case: no np.unique (~15 us a call on the loop thread)
            which, times = at, 1
        else:
            which, times = np.unique(at, return_counts=True)
        short = self._pins[which] < times          # more unpins than pins (a slot may repeat)
        if short.any():
            raise ValueError(f"slot={which[short][0]}: unpin without pin")
        self._pins[which] -= times

    def release_many(self, slots: Sequence[int]) -> None:
        """Free every slot of ``slots``, each checked (in use, unpinned, named once) before any is.
        ``epoch`` and the slots' ``generations`` (where kept) go up before any is freed: a block is
        only ever written into a free slot, so a reader that looked slots up at one epoch and reads
        the same epoch after reading them read what was there at the lookup
        (`tierkv.manager.lease.Lent`); one that noted their generations at that epoch and finds them
        unchanged after reading, the same of those slots alone, whatever else was freed meanwhile."""
        at = np.array(slots, np.int64)
        if len(at) == 0:
            return
        states = self._states_at(at)
        if (states == FREE).any() or self._pins[at[states != FREE]].any() or not _distinct(at):
            seen: set[int] = set()
            for slot in map(int, at):
                if slot in seen or not self.in_use(slot):
                    raise ValueError(f"slot={slot}: already free")
                if self.pins(slot):
                    raise ValueError(f"slot={slot}: still pinned {self.pins(slot)} time(s)")
                seen.add(slot)
        self.epoch += 1    # first: a reader that found blocks here without pinning them sees it after
        if self.generations is not None:
            self.generations[at] += 1
        self._state[at] = FREE
        self._used -= len(at)
        self._released(at)

    # -- internals -------------------------------------------------------
    def _take(self, slots: np.ndarray, state: int) -> None:
        """Put FREE ``slots`` in ``state`` (a subclass that counts slots per extent hooks in here)."""
        if len(slots):
            self._cover(int(slots.max()))
            self._state[slots] = state
            self._used += len(slots)

    def _released(self, slots: np.ndarray) -> None:
        """``slots`` just became FREE: reserve them again, lowest first."""
        freed = self._freed
        if 8 * len(slots) > len(freed):      # many at once: one heapify (C) beats a push per slot
            freed.extend(slots.tolist())
            heapq.heapify(freed)
        else:
            for slot in slots.tolist():
                heapq.heappush(freed, slot)

    def _lowest_freed(self, n: int) -> list[int]:
        """The ``n`` lowest released slots (fewer if fewer are), taken off the heap."""
        freed = self._freed
        if 8 * n > len(freed):              # a large part: sort once (a sorted list is a heap)
            freed.sort()
            slots, freed[:n] = freed[:n], []
            return slots
        return [heapq.heappop(freed) for _ in range(n)]

    def _cover(self, top: int) -> None:
        """Grow the arrays to hold slot ``top``."""
        size = len(self._state)
        if top < size:
            return
        grown = min(self.capacity, max(top + 1, 2 * size, _GROW))
        self._state = np.concatenate([self._state, np.zeros(grown - size, np.int8)])
        self._pins = np.concatenate([self._pins, np.zeros(grown - size, np.int32)])
        if self.generations is not None:
            self.generations = np.concatenate([self.generations, np.zeros(grown - size, np.uint32)])

    def _inside(self, slots: Sequence[int]) -> np.ndarray:
        at = np.array(slots, np.int64)
        bad = at[(at < 0) | (at >= self.capacity)]
        if len(bad):
            raise ValueError(f"slot={bad[0]}: outside 0..{self.capacity - 1}")
        return at

    def _states_at(self, at: np.ndarray) -> np.ndarray:
        """The state code of each slot of ``at`` (slots past the arrays are FREE)."""
        size = len(self._state)
        if len(at) == 0 or (at.min() >= 0 and at.max() < size):
            return self._state[at]
        inside = (at >= 0) & (at < size)
        states = np.zeros(len(at), np.int8)
        states[inside] = self._state[at[inside]]
        return states

    def _checked(self, slots: Sequence[int], expected: int) -> np.ndarray:
        """``slots`` as an array, each checked to be in ``expected`` state before anything changes."""
        at = np.array(slots, np.int64)
        try:    # as unsigned, a negative slot is past the arrays too: one indexing checks both bounds
            states = self._state[at.view(np.uint64)]
        except IndexError:
            states = self._states_at(at)
        if (states != expected).any():
            wrong = np.flatnonzero(states != expected)
            first = wrong[0]
            raise ValueError(f"slot={at[first]}: is {_STATES[states[first]].value}, "
                             f"expected {_STATES[expected].value}")
        return at

    def _expect(self, slot: int, expected: int) -> None:
        state = self._state.item(slot) if 0 <= slot < len(self._state) else FREE
        if state != expected:
            raise ValueError(f"slot={slot}: is {_STATES[state].value}, expected {_STATES[expected].value}")


def _distinct(slots: Sequence[int]) -> bool:
    """Whether no slot repeats (a set of a batch's Python ints costs ~2 us)."""
    return len(set(slots.tolist() if isinstance(slots, np.ndarray) else slots)) == len(slots)
