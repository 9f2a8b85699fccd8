"""The NVMe store's slots as one process sees them: its own extents, and the blocks of others.

A `SharedPool` is the tier's `BlockPool` (the manager reserves, commits, pins
and releases through it as for any tier), with slots split by who owns their
extent (tierkv.tiers.nvme_share)::

    extent     0              1              2              3
    claims     this process   pid 4711       unclaimed      unclaimed
    records    R R . W        R . . R        R . . .        . . . .       R READY, W RESERVED, . none
               own            foreign        foreign        -
    reserve    free own slots only (1 here); with none left, claim the lowest unclaimed extent
               that has a free slot (2) and adopt it: its blocks become this process's own;
               at most an equal share of the extents among the processes that have the store open
    release    an own slot becomes free to reuse; a foreign one is only forgotten here
    free       free own slots + free slots of unclaimed extents (1 + 3 + 4 here)

Records of foreign slots are blocks another process wrote that this one may
read; `add_ready` makes one visible (see tierkv.tiers.nvme_view). Slots in
``kept`` hold a block the journal says is live but this process does not show
(a second copy of a block shown elsewhere, one forgotten here only, one waiting
for its slot's old record to go): they are never handed out as free, also
once their extent is this process's; the view takes them in (`take_own`) or
lets them go (`let_go`). Every method
runs on the thread that uses the pool (the manager's loop), but `owns`, a set
lookup the I/O workers ask too; the claims file is the only thing shared with
other processes, read and written under its lock.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.errors import BudgetExceeded, StoreUnusable
from tierkv.tiers.nvme_share import Claims
from tierkv.tiers.pool import FREE, READY, BlockPool

REAP_EVERY_S = 1.0   # a process with no free slot tries a claim at each reserve; it checks owners this often


class SharedPool(BlockPool):
    """``capacity`` slots of a shared store, of which this process (``owner``) writes its own extents'.
    Made at open, under the claims lock."""

    def __init__(self, capacity: int, claims: Claims, owner: int) -> None:
        super().__init__(capacity)
        self._claims, self._owner = claims, owner
        self._extent = claims.extent_slots
        self._own: set[int] = set()
        self._unclaimed: set[int] = set()   # as the claims table said at the last look
        self._records = np.zeros(self.extents, np.int64)   # slots in use per extent
        self._reaped = -math.inf
        self.catch_up: Callable[[], None] = lambda: None   # reads the journal's news (set by the store)
        self.adopted: Callable[[int, int], None] = lambda first, end: None   # slots [first, end) became this
                                                                            # process's (set by the store)
        self.kept: set[int] = set()         # live blocks not shown here: never free (see the module notes)
        self._look(claims.read())

    # -- queries ---------------------------------------------------------
    @property
    def extents(self) -> int:
        return -(-self.capacity // self._extent)

    def owns(self, slot: int) -> bool:
        return slot // self._extent in self._own

    def may_free(self, slots: np.ndarray) -> np.ndarray:
        """Whether dropping the block in each of ``slots`` can free that slot here: its extent is this
        process's, or nobody's (a drop claims it). Not in an extent another live process holds: that
        block is only forgotten here, and no room is made."""
        extents = self._own | self._unclaimed
        return np.isin(np.asarray(slots) // self._extent, np.fromiter(extents, np.int64, len(extents)))

    @property
    def free(self) -> int:
        return len(self._freed) + sum(self._size(x) - int(self._records[x]) for x in self._unclaimed)

    def can_reserve(self, n: int = 1) -> bool:
        """Whether ``n`` slots can be reserved now, claiming extents until they can, so that the
        `reserve` calls that follow cannot fail."""
        while len(self._freed) < n:
            if not self._claim():
                return False
        return True

    # -- transitions -----------------------------------------------------
    def reserve(self) -> int:
        if not self.can_reserve():
            raise self._full()
        return super().reserve()

    def reserve_many(self, n: int) -> list[int]:
        if not self.can_reserve(n):
            raise self._full()
        return super().reserve_many(n)

    def restore(self, slots: Sequence[int] | np.ndarray) -> None:
        """Mark these slots READY (blocks visible at open; no extent is this process's yet)."""
        if self.used:
            raise ValueError("restore needs a pool that has not been used yet")
        self._take(np.unique(self._inside(slots)), READY)

    def add_ready(self, slot: int) -> None:
        """A block another process wrote in ``slot`` is now visible here."""
        if self.owns(slot) or self.in_use(slot):
            raise ValueError(f"slot={slot}: is this process's or already in use")
        self._take(self._inside((slot,)), READY)

    def take_own(self, slot: int) -> None:
        """A block in ``slot`` of this process's extents, written by a process that has left, is shown
        here now."""
        if not self.owns(slot) or self.in_use(slot):
            raise ValueError(f"slot={slot}: is not this process's or already in use")
        self.kept.discard(slot)
        self._take(self._inside((slot,)), READY)

    def let_go(self, slot: int) -> None:
        """``slot`` holds nothing this process must keep: free to reuse once it is this process's."""
        self.kept.discard(slot)
        if self.owns(slot) and not self.in_use(slot) and slot not in self._freed:
            heapq.heappush(self._freed, slot)

    def claim_extent_of(self, slot: int) -> bool:
        """Make ``slot``'s extent this process's if nobody holds it; whether it is this process's now."""
        extent = slot // self._extent
        if extent in self._own:
            return True
        with self._claims.locked():
            self._look(self._claims.read())
            if extent not in self._unclaimed or len(self._own) >= self._share():
                return False
            self._claims.write(extent, self._owner)
        self._adopt(extent)
        return True

    def give_back(self) -> list[int]:
        """Stop owning every extent (the store is closing); the extents to unclaim."""
        extents = sorted(self._own)
        self._own.clear()
        self._freed.clear()
        return extents

    # -- internals -------------------------------------------------------
    def _full(self) -> BudgetExceeded:
        others = [o for o in self._claims.read() if o != self._owner]
        return BudgetExceeded(f"NVMe store {self._claims.owners.parent}: no free slot for this process: it "
                              f"holds {len(self._own)} of {self.extents} extents of slots (at most "
                              f"{self._share()} while {self._claims.openers()} processes have the store open), "
                              f"others are held by pid(s) {', '.join(self._claims.pids(others)) or 'none'}")

    def _claim(self) -> bool:
        """Claim the lowest unclaimed extent with a free slot, reaping dead owners if there is none."""
        with self._claims.locked():
            table = self._claims.read()
            self._look(table)
            extent = self._pick()
            if extent is None and time.monotonic() - self._reaped >= REAP_EVERY_S:
                self._reaped = time.monotonic()
                self._claims.reap(table, self._owner)
                self._look(table)
                extent = self._pick()
            if extent is None:
                return False
            self._claims.write(extent, self._owner)
        self._adopt(extent)
        return True

    def _look(self, table: list[int]) -> None:
        mine = {x for x, owner in enumerate(table) if owner == self._owner}
        if not self._own <= mine:
            raise StoreUnusable(f"NVMe store {self._claims.owners.parent}: extents {sorted(self._own - mine)} of "
                                f"this process were unclaimed by another (was its owner file removed?); "
                                f"close and reopen the store")
        self._unclaimed = {x for x in range(self.extents) if x >= len(table) or table[x] == 0}

    def _pick(self) -> int | None:
        """The lowest unclaimed extent with a free slot, while this process holds less than its share."""
        if len(self._own) >= self._share():
            return None
        return min((x for x in self._unclaimed if self._records[x] < self._size(x)), default=None)

    def _share(self) -> int:
        """The extents a process may hold: an equal part among the processes that have the store open."""
        return -(-self.extents // max(1, self._claims.openers()))

    def _adopt(self, extent: int) -> None:
        """Make ``extent`` this process's: its free slots are those nobody's block is in, as the journal
        says now (its last owner may have written since this process last read it)."""
        self.catch_up()
        self._own.add(extent)
        self._unclaimed.discard(extent)
        first = extent * self._extent
        slots = np.arange(first, first + self._size(extent))
        for slot in slots[self._states_at(slots) == FREE].tolist():
            if slot not in self.kept:
                heapq.heappush(self._freed, slot)
        self.adopted(first, first + len(slots))

    def _size(self, extent: int) -> int:
        return min(self._extent, self.capacity - extent * self._extent)

    def _take(self, slots: np.ndarray, state: int) -> None:
        super()._take(slots, state)
        self._records += np.bincount(slots // self._extent, minlength=len(self._records)).astype(self._records.dtype)

    def _released(self, slots: np.ndarray) -> None:
        extents = slots // self._extent
        np.subtract.at(self._records, extents, 1)
        mine = slots[np.isin(extents, list(self._own))]
        if self.kept:
            mine = mine[~np.isin(mine, list(self.kept))]
        super()._released(mine)
