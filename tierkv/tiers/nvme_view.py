"""What one process shows of a store that other processes write too.

Each process keeps its own index of the shared journal: the blocks in its own
extents exactly as it wrote them, the blocks of other slots as the journal
told it so far, each with a READY record in the tier's pool, so that the
manager can pin and read them. `SharedView.apply` takes the records appended
since the last look (`Journal.tail`) and returns what changed. A record about
one of this process's own slots is its own (applied when it was written) and
skipped; so is a slot past this process's budget. For another process's slot ``t``::

    record       the index holds       then
    PUT k @t     k0 @t, k0 != k        k0 is removed: its slot was rewritten               -> removed
                 k in another slot     k stays where it is (same key, same bytes)
                 -                     k @t, slot t READY                                  -> added
                                       unless t still has a record (the manager holds a
                                       removed block there): k waits until t is released;
                                       or k was removed by this look: k waits for the next,
                                       so that the manager forgets the old copy first
    DROP_AT k @t k @t                  k is removed                                        -> removed

A removed block keeps its slot's record until the manager forgets it (a
reader may hold it: its read then fails, as the slot may already hold other
bytes). Blocks whose slot was released meanwhile come in at the next look.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tierkv.keys import BlockKey
from tierkv.tiers.journal import Index, Op, Row
from tierkv.tiers.nvme_pool import SharedPool
from tierkv.tiers.pool import SlotState


@dataclass(slots=True)
class Changes:
    """Blocks that became visible, and blocks that are gone, as (key, slot)."""

    added: list[tuple[BlockKey, int]] = field(default_factory=list)
    removed: list[tuple[BlockKey, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    def extend(self, later: Changes) -> None:
        """These changes, then ``later``'s."""
        self.added += later.added
        self.removed += later.removed


class SharedView:
    def __init__(self, index: Index, pool: SharedPool) -> None:
        self._index, self._pool = index, pool
        self._waiting: dict[int, tuple[bytes, int]] = {}   # slot -> (digest, checksum) of its newest PUT
        self._added: dict[int, bytes] = {}   # slot -> block added by this look: nobody holds it yet
        self._removed: list[tuple[BlockKey, int]] = []
        self._gone: set[bytes] = set()   # keys removed by this look

    def apply(self, rows: Iterable[Row]) -> Changes:
        self._admit_waiting()
        for op, digest, slot, checksum in rows:
            if op == Op.DROP:  # a record of a store one process had: the key leaves wherever it is
                entry = self._index.get(digest)
                slot = -1 if entry is None else entry.slot
            if not 0 <= slot < self._pool.capacity or self._pool.owns(slot):
                continue
            if op == Op.PUT:
                self._put(digest, slot, checksum)
            elif self._index.holder(slot) == digest:
                self._remove(digest, slot)
            elif self._waiting.get(slot, (None,))[0] == digest:
                del self._waiting[slot]
        changes = Changes([(BlockKey(digest), slot) for slot, digest in self._added.items()], self._removed)
        self._added, self._removed, self._gone = {}, [], set()
        return changes

    def _put(self, digest: bytes, slot: int, checksum: int) -> None:
        holder = self._index.holder(slot)
        if holder == digest:
            return
        if holder is not None:
            self._remove(holder, slot)
        if self._index.get(digest) is not None:
            return
        if self._pool.state(slot) is not SlotState.FREE or digest in self._gone:
            self._waiting[slot] = (digest, checksum)
            return
        self._add(digest, slot, checksum)

    def _admit_waiting(self) -> None:
        """Blocks that waited for their slot's record to go: in now, unless the slot became this
        process's (its owner left and this process adopted the extent)."""
        for slot, (digest, checksum) in list(self._waiting.items()):
            if self._pool.owns(slot):
                del self._waiting[slot]
            elif self._pool.state(slot) is SlotState.FREE:
                del self._waiting[slot]
                if self._index.get(digest) is None:
                    self._add(digest, slot, checksum)

    def _add(self, digest: bytes, slot: int, checksum: int) -> None:
        self._index.put(digest, slot, checksum)
        self._pool.add_ready(slot)
        self._added[slot] = digest

    def _remove(self, digest: bytes, slot: int) -> None:
        """Take the block out of the index; one added by this same look goes without a trace."""
        self._index.drop(digest, slot)
        if self._added.get(slot) == digest:
            del self._added[slot]
            self._pool.release(slot)
        else:
            self._removed.append((BlockKey(digest), slot))
            self._gone.add(digest)
