"""The directory: for every block, the slot it holds in each tier, and who waits for it where.

Blocks are immutable (a key names its content), so copies in several tiers
never disagree; any copy can be dropped while another exists. ``arriving``
holds the move in flight into a tier so that a second reader joins it
instead of loading the block twice. ``holders`` counts the sequences that
hold a block (KV a caller trusts tierkv with): while it is held its last copy
is never dropped, and a sequence that lets go of a block shared with another
one (a forked branch, a reused prefix) frees only what nobody else holds::

    seq A  [b0 b1 b2]          b0, b1: holders 2     fork shares every block
    seq B  [b0 b1 b3]          b2, b3: holders 1     A released: b2 freed, b0 b1 b3 stay

Beside the entries the directory keeps two sets of (block, tier) pairs:
``wanted`` (callers wait to pin the block there: it must not be evicted
meanwhile) and ``cold`` (a guessed prefetch put it there and nobody has read
it yet: its first read is no reuse). Nothing here touches a tier or a policy.

A block's entry is a row of arrays (tierkv.manager.rows), found by its key in
a `KeyTable` (tierkv.keytable): ~56 bytes a block in all, where Python objects
took ~390. Reads of hundreds of keys (`find`, `plan_loads`, `commit`,
`settle`) look them up in one vectorised pass::

    key   --KeyTable-->   row   --Rows-->   holders, layer, index, slot per tier, ...
"""
from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import compress, repeat
from types import MappingProxyType

import numpy as np

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey
from tierkv.keytable import KeyTable, split
from tierkv.manager.rows import NOTHING_ARRIVING, BlockEntry, Rows

Place = tuple[str, int]   # (tier, slot)


class Directory:
    def __init__(self) -> None:
        self._table = KeyTable()          # key -> row
        self._rows = Rows()
        self.wanted: Counter[tuple[BlockKey, str]] = Counter()  # blocks callers wait to pin, per tier
        self.cold: set[tuple[BlockKey, str]] = set()            # guesses inserted cold, not read yet

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._table.find(key) >= 0

    def knows_all(self, keys: Sequence[BlockKey], guesses: np.ndarray | None = None) -> bool:
        """Every key is known. ``guesses``: each key's row as a reader found it an instant ago (-1: none),
        checked without hashing; the rows found are remembered for the lookups of the same keys that
        follow (a load's plan, claim and commit)."""
        if guesses is None:
            return bool((self._table.find_many(keys) >= 0).all())
        rows = self._table.find_hinted(split(keys), guesses)
        if len(rows) and rows.min() < 0:
            return False
        self._table.note(keys, rows)
        return True

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[BlockEntry]:
        rows = self._table.ids()
        raw = self._table.keys[rows].tobytes()
        return iter([BlockEntry(key, self._rows, row) for key, row in zip(BlockKey.many(raw), rows.tolist())])

    def nbytes(self) -> int:
        """The bytes the directory's arrays take (moves in flight, waiting readers and guesses apart)."""
        return sum(self.nbytes_parts().values())

    def nbytes_parts(self) -> dict[str, int]:
        """`nbytes` array by array: the key table's, then each row column's."""
        return self._table.nbytes_parts() | self._rows.nbytes_parts()

    @property
    def table_fill(self) -> float:
        """The share of the key table's hash cells in use."""
        return self._table.fill

    def get(self, key: BlockKey) -> BlockEntry | None:
        """The entry of a key, or None."""
        row = self._table.find(key)
        return None if row < 0 else BlockEntry(key, self._rows, row)

    def entry(self, key: BlockKey) -> BlockEntry:
        entry = self.get(key)
        if entry is None:
            raise BlockMissing(f"block {key.hex()} is not stored in any tier", (key,))
        return entry

    def find_row(self, key: BlockKey) -> int:
        """The row of ``key``, or -1."""
        return self._table.find(key)

    def find_rows(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """The row of each key (-1 where unknown)."""
        return self._table.find_many(keys)

    def rows(self, keys: Sequence[BlockKey], guesses: np.ndarray | None = None, *,
             off_loop: bool = False) -> np.ndarray:
        """The row of each key; BlockMissing names those stored nowhere. ``guesses``: each key's row as an
        earlier call returned it (-1: none), checked against the key in that row; only keys guessed wrong
        are looked up (a sequence reads its pages' rows back each step, and skips the hashing).
        ``off_loop``: asked from a thread other than the loop's: the key table's memories are only read."""
        if guesses is None:
            rows = self._table.find_many(keys, remember=not off_loop)
        else:
            rows = self._table.find_hinted(split(keys), guesses)
        if len(rows) and rows.min() < 0:
            missing = [key for key, row in zip(keys, rows.tolist()) if row < 0]
            raise BlockMissing(f"block {missing[0].hex()} is not stored in any tier", tuple(missing))
        return rows

    def stored(self, keys: Sequence[BlockKey]) -> tuple[np.ndarray, np.ndarray]:
        """The row of each key (-1 where unknown), and whether its block has a copy somewhere or one
        on its way: a stored document's million pages in a few numpy passes."""
        rows = self._table.find_many(keys)
        stored = rows >= 0
        known = rows[stored]
        present = self._rows.copy_counts(known) > 0
        if self._rows.arriving:
            present |= np.isin(known, np.fromiter(self._rows.arriving, np.int64, len(self._rows.arriving)))
        stored[stored] = present
        return rows, stored

    def hold_rows(self, rows: np.ndarray) -> None:
        """One more holder for each of ``rows`` (a row named twice gets two)."""
        np.add.at(self._rows.meta["holders"], rows, 1)

    def held_count(self) -> int:
        """Blocks some sequence holds, in one pass over the holders column (a released row's is 0): the
        same cost with a million stored blocks as with none held."""
        return int(np.count_nonzero(self._rows.meta["holders"]))

    def let_go(self, keys: Sequence[BlockKey]) -> None:
        """One holder fewer for each known key (never below none; a key named twice lets go twice)."""
        rows = self._table.find_many(keys)
        rows = rows[rows >= 0]
        holders = self._rows.meta["holders"]
        np.subtract.at(holders, rows, 1)
        holders[rows] = np.maximum(holders[rows], 0)

    def add(self, key: BlockKey, *, hold: bool, layer: int | None = None,
            index: int | None = None) -> BlockEntry:
        """The entry of ``key``, made if new; ``hold``: one more holder."""
        row = self._table.find(key)
        rows = self._rows
        if row < 0:
            row = rows.take()
            self._table.add(key, row)
        rows.holders[row] += hold
        if layer is not None:
            rows.layers[row] = layer + 1
        if index is not None:
            rows.indexes[row] = index + 1
        return BlockEntry(key, rows, row)

    def add_many(self, keys: Sequence[BlockKey], *, hold: bool, layer: int | None = None,
                 first_index: int | None = None) -> np.ndarray:
        """`add` of each key (``keys[i]`` at index ``first_index + i``) in a few numpy passes; whether each
        block was stored before (a copy somewhere, or one on its way). A key named twice is made once."""
        rows, stored = self.stored(keys)
        new = np.flatnonzero(rows < 0)
        if len(new) and len({keys[i] for i in new.tolist()}) < len(new):    # (rare: one key by one)
            for i, key in enumerate(keys):
                self.add(key, hold=hold, layer=layer, index=None if first_index is None else first_index + i)
            return stored
        if len(new):
            rows[new] = self._rows.take_many(len(new))
            self._table.add_many(split(keys)[new], rows[new])
        meta = self._rows.meta
        if hold:
            self.hold_rows(rows)
        if layer is not None:
            meta["layer"][rows] = layer + 1
        if first_index is not None:
            meta["index"][rows] = np.arange(first_index + 1, first_index + 1 + len(keys))
        return stored

    def add_copies(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int]) -> None:
        """``keys[i]`` READY in ``slots[i]`` of ``name``, made where new and held by nobody (a reopened
        store's blocks: a million at once). The keys are distinct and have no copy in ``name`` yet."""
        rows = self._table.find_many(keys)
        new = np.flatnonzero(rows < 0)
        if len(new):
            rows[new] = self._rows.take_many(len(new))
            self._table.add_many(split(keys)[new], rows[new])
        self._rows.column(name)
        self._rows.tiers[name][rows] = np.asarray(slots, np.int32) + 1

    def forget_if_empty(self, key: BlockKey) -> None:
        row = self._table.find(key)
        if row >= 0:
            self._forget_if_empty(row)

    def _forget_empty(self, rows: np.ndarray) -> None:
        """`_forget_if_empty` of each row, the rows with a copy skipped in one pass."""
        for row in rows[self._rows.copy_counts(rows) == 0].tolist():
            self._forget_if_empty(row)

    def _forget_if_empty(self, row: int) -> None:
        if row not in self._rows.arriving and not self._rows.copied(row):
            self._table.remove(row)
            self._rows.release(row)

    # -- lookups ------------------------------------------------------------
    def tiers_of(self, key: BlockKey, order: Sequence[str]) -> list[str]:
        """The tiers holding a copy of ``key``, in ``order``."""
        entry = self.get(key)
        return [] if entry is None else [n for n in order if n in entry.copies]

    def holds(self, key: BlockKey, names: Sequence[str]) -> bool:
        """Some tier of ``names`` holds a copy of ``key``."""
        row = self._table.find(key)
        slots = self._rows.slots
        return row >= 0 and any(name in slots and slots[name][row] for name in names)

    def find(self, keys: Sequence[BlockKey], names: Sequence[str]) -> list[Place | None]:
        """Where each key can be read in place: (tier, slot) in the first of ``names`` holding it, or
        None. The hot path of every read: one vectorised lookup of the keys, then one gather per tier."""
        rows = self._table.find_many(keys)
        found: list[Place | None] = [None] * len(rows)
        known = rows >= 0
        left = np.flatnonzero(known)
        for name in names:
            if not len(left):
                break
            slots = self._rows.slots_of(rows[left], name)
            here = slots >= 0
            if len(left) == len(rows) and here.all():   # every key in this tier: the usual read, built in C
                return list(zip(repeat(name), slots.tolist()))
            for i, slot in zip(left[here].tolist(), slots[here].tolist()):
                found[i] = (name, slot)
            left = left[~here]
        return found

    def guard(self, key: BlockKey, name: str) -> tuple[int, int, int] | None:
        """(slot in ``name`` or -1, holders, tiers holding a copy) of ``key``, or None if unknown: what
        an eviction checks of each candidate, in one lookup."""
        row = self._table.find(key)
        if row < 0:
            return None
        column = self._rows.slots.get(name)
        slot = column[row] - 1 if column is not None else -1
        return slot, self._rows.holders[row], sum(1 for c in self._rows.slots.values() if c[row])

    def guards(self, keys: Sequence[BlockKey], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`guard` of each key, in one lookup: holders, tiers holding a copy, slot in ``name`` (-1: none
        there, or the key is unknown)."""
        rows = self._table.find_many(keys)
        known = rows >= 0
        at = np.where(known, rows, 0)
        slots = np.where(known, self._rows.slots_of(at, name), -1)
        return self._rows.meta["holders"][at], self._rows.copy_counts(at), slots

    def counts(self, keys: Sequence[BlockKey], name: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per key: holders, tiers holding a copy, and whether ``name`` holds one (BlockMissing names
        keys stored nowhere)."""
        rows = self.rows(keys)
        return self._rows.meta["holders"][rows], self._rows.copy_counts(rows), self._rows.slots_of(rows, name) >= 0

    def slots_in(self, keys: Sequence[BlockKey], name: str) -> np.ndarray:
        """Each key's slot in ``name`` (-1: no copy there); BlockMissing names keys stored nowhere."""
        return self._rows.slots_of(self.rows(keys), name)

    def slots_and_rows(self, keys: Sequence[BlockKey], name: str, guesses: np.ndarray | None = None, *,
                       off_loop: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """`slots_in`, and the rows found (``guesses``: see ``rows``). ``off_loop``: asked from a thread
        other than the loop's, while the loop may change the directory: the key table's memories are
        only read, and a row that no longer holds its key once its slot is read reads as no copy (its
        block let go of and the row taken by another block meanwhile: no slot of ``name`` was freed)."""
        rows = self.rows(keys, guesses, off_loop=off_loop)
        slots = self._rows.slots_of(rows, name)
        if off_loop:
            slots[~self._table.holding(split(keys), rows)] = -1
        return slots, rows

    def plan_loads(self, keys: Sequence[BlockKey], dst: str,
                   order: Sequence[str]) -> tuple[dict[str, list[BlockKey]], list[tuple[BlockKey, asyncio.Future]]]:
        """What making ``keys`` resident in ``dst`` takes: the keys to copy from each source tier (the
        first of ``order`` holding them), and the moves into ``dst`` already in flight to join (key,
        move). Keys already in ``dst`` need nothing; BlockMissing names keys stored nowhere."""
        rows = self.rows(keys)
        there = self._rows.slots_of(rows, dst) >= 0
        source = np.full(len(rows), -1)
        for i, name in reversed(list(enumerate(order))):   # the first tier of ``order`` holding it wins
            source[self._rows.slots_of(rows, name) >= 0] = i
        need = ~there
        joins: list[tuple[BlockKey, asyncio.Future]] = []
        arriving = self._rows.arriving
        if arriving.keys() & rows[need].tolist():     # moves into ``dst`` in flight are joined, not repeated
            for i in np.flatnonzero(need).tolist():
                move = arriving.get(int(rows[i]), NOTHING_ARRIVING).get(dst)
                if move is not None:
                    joins.append((keys[i], move))
                    need[i] = False
        if (source[need] < 0).any():
            missing = list(compress(keys, (need & (source < 0)).tolist()))
            raise BlockMissing(f"block {missing[0].hex()} is not stored in any tier", tuple(missing))
        loads = {order[i]: list(compress(keys, (need & (source == i)).tolist()))
                 for i in np.unique(source[need]).tolist()}
        return loads, joins

    def arrive(self, keys: Sequence[BlockKey], name: str, done: asyncio.Future) -> None:
        """The move ``done`` brings ``keys`` into ``name`` (readers of them join it). A row's record of
        its moves in flight is never changed in place, so the rows of one move share one record."""
        arriving, rows = self._rows.arriving, self.rows(keys).tolist()
        record = MappingProxyType({name: done})
        if arriving.keys().isdisjoint(rows):   # the usual move: nothing else arriving for these blocks
            arriving.update(zip(rows, repeat(record)))
            return
        for row in rows:
            moves = arriving.get(row)
            arriving[row] = record if moves is None else MappingProxyType({**moves, name: done})

    # -- bulk changes -------------------------------------------------------------
    def commit(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int],
               skip: Container[BlockKey] = ()) -> tuple[list[BlockKey], list[int], list[int]]:
        """Record ``keys[i]`` READY in ``slots[i]`` of ``name``: (keys added, their slots, slots spare).
        A slot is spare where its key is gone, in ``skip``, or already has a copy there."""
        rows = self._table.find_many(keys)
        self._rows.column(name)  # made on first use
        known = rows >= 0
        has = np.zeros(len(rows), bool)
        has[known] = self._rows.slots_of(rows[known], name) >= 0
        ok = known & ~has        # (keys are distinct, so are their rows)
        if skip:
            ok &= ~np.fromiter(map(skip.__contains__, keys), bool, count=len(keys))
        at = np.array(slots, np.int64)
        self._rows.tiers[name][rows[ok]] = at[ok] + 1
        return list(compress(keys, ok.tolist())), at[ok].tolist(), at[~ok].tolist()

    def settle(self, keys: Sequence[BlockKey], name: str, done: asyncio.Future) -> None:
        """The move ``done`` of ``keys`` into ``name`` is over; a block left with no copy and nothing
        arriving is forgotten."""
        rows = self._table.find_many(keys)
        rows = rows[rows >= 0]
        arriving, known = self._rows.arriving, rows.tolist()
        moves = list(map(arriving.get, known))
        only = moves[0] if moves else None       # the usual move: every block's record is {name: done} alone
        if only is not None and len(only) == 1 and only.get(name) is done and moves.count(only) == len(moves):
            deque(map(arriving.pop, known, repeat(None)), maxlen=0)   # (count compared them all by value)
        else:
            for row in known:      # each record looked up afresh: a key named twice finds it settled
                move = arriving.get(row)
                if move is not None and move.get(name) is done:
                    left = {other: future for other, future in move.items() if other != name}
                    if left:
                        arriving[row] = MappingProxyType(left)
                    else:
                        del arriving[row]
        self._forget_empty(rows)

    def remove_copies(self, keys: Sequence[BlockKey], name: str) -> list[int]:
        """Take the copies in ``name`` of ``keys`` (each has one) out; their slots. A block left with
        no copy and nothing arriving is forgotten."""
        rows = self.rows(keys)
        slots = self._rows.slots_of(rows, name)
        if len(slots) and slots.min() < 0:
            raise KeyError(name)
        self._rows.tiers[name][rows] = 0
        self._forget_empty(rows)
        return slots.tolist()

    # -- readers waiting ---------------------------------------------------------
    def want(self, items: Iterable[tuple[BlockKey, str]]) -> None:
        """Callers wait to pin these (block, tier) pairs: keep them there until ``unwant``."""
        self.wanted.update(items)

    def unwant(self, items: Iterable[tuple[BlockKey, str]]) -> None:
        wanted, drop = self.wanted, dict.__delitem__    # (a Counter's own del runs Python code per item)
        items = list(items)
        if items and len(items) == len(wanted) and max(wanted.values()) == 1 and wanted.keys() == set(items):
            wanted.clear()      # the usual read: its items were the only ones, each wanted once
            return
        for item in items:
            if (left := wanted[item] - 1) > 0:
                wanted[item] = left
            else:
                drop(wanted, item)

    def order(self, name: str) -> np.ndarray:
        """`Rows.order`: a policy's stamp per row for ``name`` (tierkv.manager.array_lru)."""
        return self._rows.order(name)

    def key_of(self, row: int) -> BlockKey:
        return BlockKey(self._table.key(row))
