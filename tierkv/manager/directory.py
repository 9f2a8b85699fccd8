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

The entries live in arrays, a row per block (a 1M-token document is a million
pages): the key in a `KeyTable`, then a column each for holders, layer,
index, and the slot in each tier, ~55 bytes a block where Python objects took
~390. Moves in flight sit in a dict by row (few at a time). A `BlockEntry`
is a view of one row, made on demand; a row is reused once its block is
forgotten, so a view checks its row's generation and reads as an empty entry
(writes to it go nowhere) once the block it named is gone. Reads of hundreds
of keys (`find`, `entries`, `commit`) look them up in one vectorised pass::

    row     key      holders  layer+1  index+1  gen   slot+1 per tier: cpu  nvme
    0       k7       1        3        12       0                    4    0       (0: none)
    1       k3       0        3        13       2                    0    17
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from tierkv.errors import BlockMissing
from tierkv.keys import KEY_BYTES, BlockKey
from tierkv.keytable import KeyTable, split, widen


NOTHING_ARRIVING: Mapping[str, asyncio.Future] = MappingProxyType({})
Place = tuple[str, int]   # (tier, slot)


class BlockEntry:
    """One block's row of the directory (a view: see the module's docstring)."""

    __slots__ = ("key", "_d", "_row", "_gen")

    def __init__(self, key: BlockKey, directory: Directory, row: int, gen: int) -> None:
        self.key, self._d, self._row, self._gen = key, directory, row, gen

    @property
    def live(self) -> bool:
        """The block is still in the directory (not forgotten since this view was made)."""
        return self._d._gens[self._row] == self._gen

    @property
    def holders(self) -> int:
        return self._d._holders[self._row] if self.live else 0

    @holders.setter
    def holders(self, n: int) -> None:
        if self.live:
            self._d._holders[self._row] = n

    @property
    def protected(self) -> bool:
        return self.holders > 0

    @property
    def layer(self) -> int | None:
        value = self._d._layers[self._row] if self.live else 0
        return value - 1 if value else None

    @property
    def index(self) -> int | None:
        value = self._d._indexes[self._row] if self.live else 0
        return value - 1 if value else None

    @property
    def copies(self) -> Copies:
        """Tier -> READY slot."""
        return Copies(self)

    @property
    def arriving(self) -> Mapping[str, asyncio.Future]:
        """Tier -> move in flight."""
        return self._d._arriving.get(self._row, NOTHING_ARRIVING) if self.live else NOTHING_ARRIVING

    def arrive(self, tier: str, done: asyncio.Future) -> None:
        if self.live:
            self._d._arriving.setdefault(self._row, {})[tier] = done

    def settle(self, tier: str, done: asyncio.Future) -> None:
        """The move ``done`` into ``tier`` is over (another may have replaced it since)."""
        moves = self._d._arriving.get(self._row) if self.live else None
        if moves is not None and moves.get(tier) is done:
            del moves[tier]
            if not moves:
                del self._d._arriving[self._row]

    def __repr__(self) -> str:
        return f"BlockEntry({self.key!r}, holders={self.holders}, copies={dict(self.copies)})"


class Copies:
    """A block's READY slot in each tier holding it, as a mapping (tier -> slot) read and written in
    place."""

    __slots__ = ("_entry",)

    def __init__(self, entry: BlockEntry) -> None:
        self._entry = entry

    def get(self, name: str, default: int | None = None) -> int | None:
        entry = self._entry
        column = entry._d._slots.get(name)
        value = column[entry._row] if column is not None and entry.live else 0
        return value - 1 if value else default

    def __getitem__(self, name: str) -> int:
        slot = self.get(name)
        if slot is None:
            raise KeyError(name)
        return slot

    def __contains__(self, name: object) -> bool:
        return self.get(name) is not None  # type: ignore[arg-type]

    def __setitem__(self, name: str, slot: int) -> None:
        entry = self._entry
        if entry.live:
            entry._d._column(name)[entry._row] = slot + 1

    def pop(self, name: str, *default: int | None) -> int | None:
        slot = self.get(name)
        if slot is None:
            if default:
                return default[0]
            raise KeyError(name)
        self._entry._d._slots[name][self._entry._row] = 0
        return slot

    def __iter__(self) -> Iterator[str]:
        entry = self._entry
        if not entry.live:
            return iter(())
        return iter([name for name, column in entry._d._slots.items() if column[entry._row]])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return any(True for _ in self)

    def keys(self) -> list[str]:
        return list(self)

    def items(self) -> list[tuple[str, int]]:
        return [(name, self[name]) for name in self]

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == other if isinstance(other, Mapping) else NotImplemented

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class Directory:
    def __init__(self) -> None:
        self._table = KeyTable()
        self._rows = 0                    # rows ever used; forgotten ones wait in _free
        self._free: list[int] = []
        self._arriving: dict[int, dict[str, asyncio.Future]] = {}   # row -> tier -> move in flight
        self._meta: dict[str, np.ndarray] = {}       # holders, layer + 1, index + 1, generation per row
        self._tiers: dict[str, np.ndarray] = {}      # tier -> slot + 1 per row (0: no copy there)
        self._slots: dict[str, memoryview] = {}      # the same, for reads of one row
        self._orders: dict[str, np.ndarray] = {}     # tier -> a policy's stamp per row (see ArrayLRU)
        self._grow(16)
        self.wanted: Counter[tuple[BlockKey, str]] = Counter()  # blocks callers wait to pin, per tier
        self.cold: set[tuple[BlockKey, str]] = set()            # guesses inserted cold, not read yet

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._table.find(key) >= 0

    def knows_all(self, keys: Sequence[BlockKey]) -> bool:
        return bool((self._table.find_many(keys) >= 0).all())

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[BlockEntry]:
        rows = self._table.ids()
        raw = self._table.keys[rows].tobytes()
        return iter([BlockEntry(BlockKey(raw[i * KEY_BYTES:(i + 1) * KEY_BYTES]), self, row, self._gens[row])
                     for i, row in enumerate(rows.tolist())])

    def nbytes(self) -> int:
        """The bytes the directory's arrays take (moves in flight, waiting readers and guesses apart)."""
        arrays = (*self._meta.values(), *self._tiers.values(), *self._orders.values())
        return self._table.nbytes() + sum(a.nbytes for a in arrays)

    def get(self, key: BlockKey) -> BlockEntry | None:
        """The entry of a key, or None."""
        row = self._table.find(key)
        return None if row < 0 else BlockEntry(key, self, row, self._gens[row])

    def entry(self, key: BlockKey) -> BlockEntry:
        entry = self.get(key)
        if entry is None:
            raise BlockMissing(f"block {key.hex()} is not stored in any tier", (key,))
        return entry

    def entries(self, keys: Sequence[BlockKey]) -> list[BlockEntry]:
        """`entry` of each key, in one lookup (a read's hundreds of keys)."""
        rows = self.rows(keys)
        gens = self._meta["gen"][rows].tolist()
        return [BlockEntry(key, self, row, gen) for key, row, gen in zip(keys, rows.tolist(), gens)]

    def find_row(self, key: BlockKey) -> int:
        """The row of ``key``, or -1."""
        return self._table.find(key)

    def find_rows(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """The row of each key (-1 where unknown)."""
        return self._table.find_many(keys)

    def rows(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """The row of each key; BlockMissing names those stored nowhere."""
        rows = self._table.find_many(keys)
        if len(rows) and rows.min() < 0:
            missing = [key for key, row in zip(keys, rows.tolist()) if row < 0]
            raise BlockMissing(f"block {missing[0].hex()} is not stored in any tier", tuple(missing))
        return rows

    def add(self, key: BlockKey, *, hold: bool, layer: int | None = None,
            index: int | None = None) -> BlockEntry:
        """The entry of ``key``, made if new; ``hold``: one more holder."""
        row = self._table.find(key)
        if row < 0:
            row = self._free.pop() if self._free else self._new_row()
            self._table.add(key, row)
        self._holders[row] += hold
        if layer is not None:
            self._layers[row] = layer + 1
        if index is not None:
            self._indexes[row] = index + 1
        return BlockEntry(key, self, row, self._gens[row])

    def add_copies(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int]) -> None:
        """``keys[i]`` READY in ``slots[i]`` of ``name``, made where new and held by nobody (a reopened
        store's blocks: a million at once). The keys are distinct and have no copy in ``name`` yet."""
        rows = self._table.find_many(keys)
        new = np.flatnonzero(rows < 0)
        if len(new):
            reused = self._free[len(self._free) - min(len(new), len(self._free)):]
            del self._free[len(self._free) - len(reused):]
            fresh = len(new) - len(reused)
            if self._rows + fresh > len(self._gens):
                self._grow(max(self._rows + fresh, 2 * self._rows))
            rows[new] = np.concatenate([np.array(reused, np.int64), np.arange(self._rows, self._rows + fresh)])
            self._rows += fresh
            self._table.add_many(split(keys)[new], rows[new])
        self._column(name)
        self._tiers[name][rows] = np.asarray(slots, np.int32) + 1

    def forget_if_empty(self, key: BlockKey) -> None:
        row = self._table.find(key)
        if row >= 0:
            self._forget_if_empty(row)

    def _copy_counts(self, rows: np.ndarray) -> np.ndarray:
        """How many tiers hold a copy of each row's block."""
        counts = np.zeros(len(rows), np.int64)
        for column in self._tiers.values():
            counts += column[rows] > 0
        return counts

    def _forget_empty(self, rows: np.ndarray) -> None:
        """`_forget_if_empty` of each row, the rows with a copy skipped in one pass."""
        copied = np.zeros(len(rows), bool)
        for column in self._tiers.values():
            copied |= column[rows] > 0
        for row in rows[~copied].tolist():
            self._forget_if_empty(row)

    def _forget_if_empty(self, row: int) -> None:
        if row not in self._arriving and not any(column[row] for column in self._slots.values()):
            self._table.remove(row)
            self._gens[row] += 1
            self._holders[row] = self._layers[row] = self._indexes[row] = 0
            for stamps in self._orders.values():
                stamps[row] = 0
            self._free.append(row)

    # -- lookups ------------------------------------------------------------
    def tiers_of(self, key: BlockKey, order: Sequence[str]) -> list[str]:
        """The tiers holding a copy of ``key``, in ``order``."""
        entry = self.get(key)
        return [] if entry is None else [n for n in order if n in entry.copies]

    def holds(self, key: BlockKey, names: Sequence[str]) -> bool:
        """Some tier of ``names`` holds a copy of ``key``."""
        row = self._table.find(key)
        return row >= 0 and any(name in self._slots and self._slots[name][row] for name in names)

    def find(self, keys: Sequence[BlockKey], names: Sequence[str]) -> list[Place | None]:
        """Where each key can be read in place: (tier, slot) in the first of ``names`` holding it, or
        None. The hot path of every read: one vectorised lookup of the keys, then one gather per tier."""
        rows = self._table.find_many(keys)
        found: list[Place | None] = [None] * len(rows)
        known = rows >= 0
        left = np.flatnonzero(known)
        for name in names:
            if not len(left) or name not in self._tiers:
                continue
            slots = self._tiers[name][rows[left]]
            here = slots > 0
            for i, slot in zip(left[here].tolist(), (slots[here] - 1).tolist()):
                found[i] = (name, slot)
            left = left[~here]
        return found

    def guard(self, key: BlockKey, name: str) -> tuple[int, int, int] | None:
        """(slot in ``name`` or -1, holders, tiers holding a copy) of ``key``, or None if unknown: what
        an eviction checks of each candidate, in one lookup."""
        row = self._table.find(key)
        if row < 0:
            return None
        column = self._slots.get(name)
        slot = column[row] - 1 if column is not None else -1
        copies = 0
        for c in self._slots.values():
            if c[row]:
                copies += 1
        return slot, self._holders[row], copies

    def guards(self, keys: Sequence[BlockKey], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`guard` of each key, in one lookup: holders, tiers holding a copy, slot in ``name`` (-1: none
        there, or the key is unknown)."""
        rows = self._table.find_many(keys)
        known = rows >= 0
        at = np.where(known, rows, 0)
        slots = self._tiers[name][at].astype(np.int64) - 1 if name in self._tiers else np.full(len(rows), -1)
        return self._meta["holders"][at], self._copy_counts(at), np.where(known, slots, -1)

    def counts(self, keys: Sequence[BlockKey], name: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per key: holders, tiers holding a copy, and whether ``name`` holds one (BlockMissing names
        keys stored nowhere)."""
        rows = self.rows(keys)
        copies = self._copy_counts(rows)
        there = self._tiers[name][rows] > 0 if name in self._tiers else np.zeros(len(rows), bool)
        return self._meta["holders"][rows], copies, there

    def slots_in(self, keys: Sequence[BlockKey], name: str) -> np.ndarray:
        """Each key's slot in ``name`` (-1: no copy there); BlockMissing names keys stored nowhere."""
        rows = self.rows(keys)
        return self._tiers[name][rows].astype(np.int64) - 1 if name in self._tiers else np.full(len(rows), -1)

    def plan_loads(self, keys: Sequence[BlockKey], dst: str,
                   order: Sequence[str]) -> tuple[dict[str, list[BlockKey]], list[tuple[BlockKey, asyncio.Future]]]:
        """What making ``keys`` resident in ``dst`` takes: the keys to copy from each source tier (the
        first of ``order`` holding them), and the moves into ``dst`` already in flight to join (key,
        move). Keys already in ``dst`` need nothing; BlockMissing names keys stored nowhere."""
        rows = self.rows(keys)
        there = self._tiers[dst][rows] > 0 if dst in self._tiers else np.zeros(len(rows), bool)
        source = np.full(len(rows), -1)
        for i, name in reversed(list(enumerate(order))):   # the first tier of ``order`` holding it wins
            if name in self._tiers:
                source[self._tiers[name][rows] > 0] = i
        loads: dict[str, list[BlockKey]] = {}
        joins: list[tuple[BlockKey, asyncio.Future]] = []
        arriving = self._arriving
        for key, row, here, i in zip(keys, rows.tolist(), there.tolist(), source.tolist()):
            if here:
                continue
            move = arriving.get(row, NOTHING_ARRIVING).get(dst)
            if move is not None:
                joins.append((key, move))
            elif i < 0:
                raise BlockMissing(f"block {key.hex()} is not stored in any tier", (key,))
            else:
                loads.setdefault(order[i], []).append(key)
        return loads, joins

    def arrive(self, keys: Sequence[BlockKey], name: str, done: asyncio.Future) -> None:
        """The move ``done`` brings ``keys`` into ``name`` (readers of them join it)."""
        arriving = self._arriving
        for row in self.rows(keys).tolist():
            moves = arriving.get(row)
            if moves is None:
                moves = arriving[row] = {}
            moves[name] = done

    # -- bulk changes -------------------------------------------------------------
    def commit(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int],
               skip: Container[BlockKey] = ()) -> tuple[list[BlockKey], list[int], list[int]]:
        """Record ``keys[i]`` READY in ``slots[i]`` of ``name``: (keys added, their slots, slots spare).
        A slot is spare where its key is gone, in ``skip``, or already has a copy there."""
        rows = self._table.find_many(keys)
        column = self._column(name)
        array = self._tiers[name]
        added, taken, spare = [], [], []
        has = np.zeros(len(rows), bool)
        known = rows >= 0
        has[known] = array[rows[known]] > 0
        for key, slot, row, there in zip(keys, slots, rows.tolist(), has.tolist()):
            if row < 0 or there or key in skip:
                spare.append(slot)
                continue
            column[row] = slot + 1
            added.append(key)
            taken.append(slot)
        return added, taken, spare

    def settle(self, keys: Sequence[BlockKey], name: str, done: asyncio.Future) -> None:
        """The move ``done`` of ``keys`` into ``name`` is over; a block left with no copy and nothing
        arriving is forgotten."""
        rows = self._table.find_many(keys)
        rows = rows[rows >= 0]
        arriving = self._arriving
        for row in rows.tolist():
            moves = arriving.get(row)
            if moves is not None and moves.get(name) is done:
                del moves[name]
                if not moves:
                    del arriving[row]
        self._forget_empty(rows)

    def remove_copies(self, keys: Sequence[BlockKey], name: str) -> list[int]:
        """Take the copies in ``name`` of ``keys`` (each has one) out; their slots. A block left with
        no copy and nothing arriving is forgotten."""
        rows = self.rows(keys)
        array = self._tiers[name]
        slots = array[rows] - 1
        if len(slots) and slots.min() < 0:
            raise KeyError(name)
        array[rows] = 0
        self._forget_empty(rows)
        return slots.tolist()

    # -- readers waiting ---------------------------------------------------------
    def want(self, items: Iterable[tuple[BlockKey, str]]) -> None:
        """Callers wait to pin these (block, tier) pairs: keep them there until ``unwant``."""
        self.wanted.update(items)

    def unwant(self, items: Iterable[tuple[BlockKey, str]]) -> None:
        for item in items:
            if (left := self.wanted[item] - 1) > 0:
                self.wanted[item] = left
            else:
                del self.wanted[item]

    # -- inside ---------------------------------------------------------------
    def _new_row(self) -> int:
        if self._rows == len(self._gens):
            self._grow(2 * self._rows)
        self._rows += 1
        return self._rows - 1

    def order(self, name: str) -> np.ndarray:
        """A column of int64 stamps per row for ``name``'s eviction order, zeroed when a row is
        forgotten (tierkv.manager.array_lru); fetch it anew after rows are added (it grows)."""
        if name not in self._orders:
            self._orders[name] = np.zeros(len(self._gens), np.int64)
        return self._orders[name]

    def key_of(self, row: int) -> BlockKey:
        return BlockKey(self._table.key(row))

    def _column(self, name: str) -> memoryview:
        if name not in self._slots:
            self._tiers[name] = np.zeros(len(self._gens), np.int32)
            self._slots[name] = memoryview(self._tiers[name])
        return self._slots[name]

    def _grow(self, rows: int) -> None:
        kinds = {"holders": np.int32, "layer": np.int16, "index": np.int32, "gen": np.uint32}
        for name, dtype in kinds.items():
            self._meta[name] = widen(self._meta.get(name, np.zeros(0, dtype)), rows)
        for name in self._tiers:
            self._tiers[name] = widen(self._tiers[name], rows)
            self._slots[name] = memoryview(self._tiers[name])
        for name in self._orders:
            self._orders[name] = widen(self._orders[name], rows)
        self._holders, self._layers = memoryview(self._meta["holders"]), memoryview(self._meta["layer"])
        self._indexes, self._gens = memoryview(self._meta["index"]), memoryview(self._meta["gen"])
