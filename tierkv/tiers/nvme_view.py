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

Every block the journal says is live keeps its slot, shown here or not. The
copies not shown are kept in mind (``_shadow``, by digest in ``_copies``, and
the pool's ``kept``): a second copy of a block shown elsewhere (processes
sharing a store may each write one), an older copy the index left at open, one
this process forgot or dropped while another process holds its slot. When the
copy shown goes, another live copy of the block comes in instead (at the next
look, one in this process's slots first); when an extent becomes this
process's (its owner left), the copies not shown in it come in as this
process's own blocks, and a block waiting there for its slot comes in once the
slot is released. A copy in this process's slots is let go (a DROP_AT
journaled, the slot free) only where this process shows the block in another
of its own slots, or drops the block. Nothing a process wrote and nobody
dropped is ever taken for free space.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tierkv.keys import BlockKey
from tierkv.tiers.block_index import Index
from tierkv.tiers.journal import Op, Row
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


Copy = tuple[bytes, int]   # a live block not shown: (digest, checksum)


class SharedView:
    def __init__(self, index: Index, pool: SharedPool, unshown: Iterable[tuple[bytes, int, int]] = (), *,
                 drop_at: Callable[[bytes, int], None] = lambda digest, slot: None) -> None:
        """``unshown``: live copies the index left out at open, as (digest, slot, checksum);
        ``drop_at(digest, slot)`` journals that a copy in one of this process's slots is gone."""
        self._index, self._pool, self._drop_at = index, pool, drop_at
        self._waiting: dict[int, Copy] = {}   # slot -> its newest PUT, waiting for the slot's old record to go
        self._shadow: dict[int, Copy] = {}    # slot -> a live copy not shown (see the module notes)
        self._copies: dict[bytes, set[int]] = {}   # digest -> its slots in _shadow
        self._added: dict[int, bytes] = {}   # slot -> block added by this look: nobody holds it yet
        self._removed: list[tuple[BlockKey, int]] = []
        self._gone: set[bytes] = set()   # keys removed by this look
        for digest, slot, checksum in unshown:
            self._set_shadow(slot, (digest, checksum))

    def apply(self, rows: Iterable[Row]) -> Changes:
        self._admit_waiting()
        for op, digest, slot, checksum in rows:
            if op == Op.DROP:  # a record of a store one process had: the key leaves wherever it is
                for other in list(self._copies.get(digest, ())):
                    self._set_shadow(other, None)
                entry = self._index.get(digest)
                slot = -1 if entry is None else entry.slot
            if not 0 <= slot < self._pool.capacity or self._pool.owns(slot):
                continue
            if op == Op.PUT:
                self._put(digest, slot, checksum)
            elif self._index.holder(slot) == digest:
                self._remove(digest, slot)
            elif self._waiting.get(slot, (None,))[0] == digest:
                self._set_waiting(slot, None)
            elif self._shadow.get(slot, (None,))[0] == digest:
                self._set_shadow(slot, None)
        return self.changes()

    def changes(self) -> Changes:
        """What changed since the last call (a look, or an extent taken)."""
        changes = Changes([(BlockKey(digest), slot) for slot, digest in self._added.items()], self._removed)
        self._added, self._removed, self._gone = {}, [], set()
        return changes

    def still_shown(self, added: list[tuple[BlockKey, int]]) -> list[tuple[BlockKey, int]]:
        """Of blocks reported added since the last look, those still shown there; one the store stopped
        showing (it wrote the block again since) is no news, and its record goes."""
        shown = []
        for key, slot in added:
            entry = self._index.get(key)
            if entry is not None and entry.slot == slot:
                shown.append((key, slot))
            elif self._index.holder(slot) is None and self._pool.in_use(slot) and not self._pool.pins(slot):
                self._pool.release(slot)
        return shown

    # -- what the store itself changed ----------------------------------------------
    def unshown(self, digest: bytes, slot: int, checksum: int) -> None:
        """The store stopped showing the copy in ``slot`` though it is still live there (it forgot or
        dropped it here only, or wrote the block again elsewhere): its slot is kept, or let go where
        this process shows its own copy."""
        self._set_shadow(slot, (digest, checksum))
        self._resolve(digest)

    def written(self, digests: Iterable[bytes]) -> None:
        """The store wrote these blocks into this process's slots: their other copies there go."""
        if self._copies or self._waiting:
            for digest in digests:
                self._resolve(digest)

    def dropped(self, digest: bytes) -> None:
        """The store dropped the block (its tier's policy chose it): its other copies in this process's
        slots go too, or the drop would free nothing."""
        waiting = [s for s, (d, _) in self._waiting.items() if d == digest] if self._waiting else []
        for slot in [s for s in [*self._copies.get(digest, ()), *waiting] if self._pool.owns(s)]:
            self._let_go(slot)

    def adopted(self, first: int, end: int) -> None:
        """Slots ``[first, end)`` became this process's: each live copy not shown there comes in as this
        process's own block, or is let go where this process shows its own copy (one waiting for its
        slot's old record comes in once the slot is released, `_admit_waiting`); a block shown there is
        this process's own now, so its other copies in this process's slots go."""
        holders = {self._index.holder(slot) for slot in range(first, end)} if self._copies or self._waiting else set()
        holders |= {digest for slot, (digest, _) in self._waiting.items() if first <= slot < end}
        for slot in [s for s in self._shadow if first <= s < end]:
            digest, checksum = self._shadow[slot]
            if self._index.get(digest) is None:
                self._set_waiting(slot, (digest, checksum))
                self._set_shadow(slot, None)
            holders.add(digest)
        for digest in holders - {None}:
            self._resolve(digest)
        self._admit_waiting()

    # -- internals ------------------------------------------------------------------
    def _put(self, digest: bytes, slot: int, checksum: int) -> None:
        self._set_shadow(slot, None)    # the slot was written again: what lay there is gone
        self._set_waiting(slot, None)
        holder = self._index.holder(slot)
        if holder == digest:
            return
        if holder is not None:
            self._remove(holder, slot)
        if self._index.get(digest) is not None:
            self._set_shadow(slot, (digest, checksum))   # a second copy of a block shown elsewhere
            return
        if self._pool.state(slot) is not SlotState.FREE or digest in self._gone:
            self._set_waiting(slot, (digest, checksum))
            return
        self._add(digest, slot, checksum)

    def _admit_waiting(self) -> None:
        """Blocks that waited for their slot's record to go: in now (as this process's own where the
        extent became this process's), or kept in mind where the block is shown in another slot."""
        for slot, (digest, checksum) in list(self._waiting.items()):
            if self._pool.state(slot) is not SlotState.FREE:
                continue
            self._set_waiting(slot, None)
            if self._index.get(digest) is None:
                self._add(digest, slot, checksum)
            else:
                self._set_shadow(slot, (digest, checksum))
                self._resolve(digest)

    def _add(self, digest: bytes, slot: int, checksum: int) -> None:
        self._set_waiting(slot, None)
        self._set_shadow(slot, None)
        self._index.put(digest, slot, checksum)
        if self._pool.owns(slot):
            self._pool.take_own(slot)
        else:
            self._pool.add_ready(slot)
        self._added[slot] = digest
        self._resolve(digest)

    def _remove(self, digest: bytes, slot: int) -> None:
        """Take the block out of the index; one added by this same look goes without a trace. Another
        live copy of it (one in this process's slots first) comes in instead, at the next look (after
        the manager forgot this one)."""
        self._index.drop(digest, slot)
        if self._added.get(slot) == digest:
            del self._added[slot]
            self._pool.release(slot)
        else:
            self._removed.append((BlockKey(digest), slot))
            self._gone.add(digest)
        others = sorted(self._copies.get(digest, ()), key=lambda s: not self._pool.owns(s))
        if others:
            self._set_waiting(others[0], self._shadow[others[0]])
            self._set_shadow(others[0], None)

    def _resolve(self, digest: bytes) -> None:
        """Where this process shows the block in its own slot, its other copies in its own slots go."""
        shown = self._index.get(digest)
        if shown is not None and self._pool.owns(shown.slot):
            self.dropped(digest)

    def _let_go(self, slot: int) -> None:
        """The copy in ``slot``, one of this process's, is not needed: journaled gone, free to reuse."""
        digest = (self._shadow.get(slot) or self._waiting.get(slot))[0]
        self._set_shadow(slot, None)
        self._set_waiting(slot, None)
        self._drop_at(digest, slot)
        self._pool.let_go(slot)

    def _set_shadow(self, slot: int, copy: Copy | None) -> None:
        old = self._shadow.pop(slot, None)
        if old is not None:
            slots = self._copies[old[0]]
            slots.discard(slot)
            if not slots:
                del self._copies[old[0]]
        if copy is not None:
            self._shadow[slot] = copy
            self._copies.setdefault(copy[0], set()).add(slot)
        self._keep(slot)

    def _set_waiting(self, slot: int, copy: Copy | None) -> None:
        if copy is None:
            self._waiting.pop(slot, None)
        else:
            self._waiting[slot] = copy
        self._keep(slot)

    def _keep(self, slot: int) -> None:
        """The pool keeps the slot of a copy recorded here (one forgotten is freed by `_let_go`, or is
        another process's, or comes in)."""
        if slot in self._waiting or slot in self._shadow:
            self._pool.kept.add(slot)
        else:
            self._pool.kept.discard(slot)
