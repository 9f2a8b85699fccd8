"""The directory's rows: each block's bookkeeping in numpy columns, and views of one row.

A 1M-token document is a million pages, so a block's bookkeeping is a row of
arrays (26 bytes with two tiers), not Python objects (~390 bytes)::

    row   holders  layer+1  index+1  gen   slot+1 per tier: cpu  nvme   stamp per ordered tier
    0     1        3        12       0                    4    0       17
    1     0        3        13       2                    0    9       0        (0: none)

Moves in flight sit in a dict by row (few at a time). A forgotten block's row
is reused: its generation goes up, so a `BlockEntry` (a view of one row, made
on demand) made before reads as an empty entry, and writes through it go
nowhere. Columns grow by doubling; their zero pages cost nothing until written
(tierkv.keytable.widen). Which key a row belongs to is the directory's business
(tierkv.manager.directory).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import numpy as np

from tierkv.keys import BlockKey
from tierkv.keytable import widen

NOTHING_ARRIVING: Mapping[str, asyncio.Future] = MappingProxyType({})
_META = {"holders": np.int32, "layer": np.int16, "index": np.int32, "gen": np.uint32}


class Rows:
    def __init__(self) -> None:
        self.used = 0                     # rows ever handed out; released ones wait in ``free``
        self.free: list[int] = []
        self.arriving: dict[int, Mapping[str, asyncio.Future]] = {}   # row -> tier -> move in flight (read-only)
        self.meta: dict[str, np.ndarray] = {}        # holders, layer + 1, index + 1, generation
        self.tiers: dict[str, np.ndarray] = {}       # tier -> slot + 1 (0: no copy there)
        self.slots: dict[str, memoryview] = {}       # the same, for reads of one row
        self.orders: dict[str, np.ndarray] = {}      # tier -> a policy's stamp (tierkv.manager.array_lru)
        self._grow(16)

    # -- rows -----------------------------------------------------------------
    def take(self) -> int:
        """A row for a new block (a released one first)."""
        if self.free:
            return self.free.pop()
        if self.used == len(self.gens):
            self._grow(2 * self.used)
        self.used += 1
        return self.used - 1

    def take_many(self, n: int) -> np.ndarray:
        """``n`` rows for new blocks at once."""
        reused = self.free[len(self.free) - min(n, len(self.free)):]
        del self.free[len(self.free) - len(reused):]
        fresh = n - len(reused)
        if self.used + fresh > len(self.gens):
            self._grow(max(self.used + fresh, 2 * self.used))
        rows = np.concatenate([np.array(reused, np.int64), np.arange(self.used, self.used + fresh)])
        self.used += fresh
        return rows

    def release(self, row: int) -> None:
        """The row's block is forgotten (it has no copy and nothing arriving): views of it go empty."""
        self.gens[row] += 1
        self.holders[row] = self.layers[row] = self.indexes[row] = 0
        for stamps in self.orders.values():
            stamps[row] = 0
        self.free.append(row)

    # -- columns -------------------------------------------------------------
    def column(self, name: str) -> memoryview:
        """Tier ``name``'s slot + 1 per row, made on first use."""
        if name not in self.slots:
            self.tiers[name] = np.zeros(len(self.gens), np.int32)
            self.slots[name] = memoryview(self.tiers[name])
        return self.slots[name]

    def order(self, name: str) -> np.ndarray:
        """A column of int32 stamps for ``name``'s eviction order, zeroed when a row is released; fetch
        it anew after rows are added (it grows)."""
        if name not in self.orders:
            self.orders[name] = np.zeros(len(self.gens), np.int32)
        return self.orders[name]

    def slots_of(self, rows: np.ndarray, name: str) -> np.ndarray:
        """Each row's slot in ``name`` (-1: no copy there)."""
        column = self.tiers.get(name)
        return np.full(len(rows), -1) if column is None else column[rows].astype(np.int64) - 1

    def copy_counts(self, rows: np.ndarray) -> np.ndarray:
        """How many tiers hold a copy of each row's block."""
        counts = np.zeros(len(rows), np.int64)
        for column in self.tiers.values():
            counts += column[rows] > 0
        return counts

    def copied(self, row: int) -> bool:
        return any(column[row] for column in self.slots.values())

    def nbytes_parts(self) -> dict[str, int]:
        """The bytes of each column."""
        return {**{name: column.nbytes for name, column in self.meta.items()},
                **{f"slot in {name}": column.nbytes for name, column in self.tiers.items()},
                **{f"{name} eviction order": column.nbytes for name, column in self.orders.items()}}

    def _grow(self, rows: int) -> None:
        for name, dtype in _META.items():
            self.meta[name] = widen(self.meta.get(name, np.zeros(0, dtype)), rows)
        for name in self.tiers:
            self.tiers[name] = widen(self.tiers[name], rows)
            self.slots[name] = memoryview(self.tiers[name])
        for name in self.orders:
            self.orders[name] = widen(self.orders[name], rows)
        self.holders, self.layers = memoryview(self.meta["holders"]), memoryview(self.meta["layer"])
        self.indexes, self.gens = memoryview(self.meta["index"]), memoryview(self.meta["gen"])


class BlockEntry:
    """One block's row (a view: see the module's docstring)."""

    __slots__ = ("key", "_rows", "_row", "_gen")

    def __init__(self, key: BlockKey, rows: Rows, row: int) -> None:
        self.key, self._rows, self._row, self._gen = key, rows, row, rows.gens[row]

    @property
    def live(self) -> bool:
        """The block is still in the directory (not forgotten since this view was made)."""
        return self._rows.gens[self._row] == self._gen

    @property
    def holders(self) -> int:
        return self._rows.holders[self._row] if self.live else 0

    @holders.setter
    def holders(self, n: int) -> None:
        if self.live:
            self._rows.holders[self._row] = n

    @property
    def protected(self) -> bool:
        return self.holders > 0

    @property
    def layer(self) -> int | None:
        value = self._rows.layers[self._row] if self.live else 0
        return value - 1 if value else None

    @property
    def index(self) -> int | None:
        value = self._rows.indexes[self._row] if self.live else 0
        return value - 1 if value else None

    @property
    def copies(self) -> Copies:
        """Tier -> READY slot."""
        return Copies(self)

    @property
    def arriving(self) -> Mapping[str, asyncio.Future]:
        """Tier -> move in flight."""
        return self._rows.arriving.get(self._row, NOTHING_ARRIVING) if self.live else NOTHING_ARRIVING

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
        column = entry._rows.slots.get(name)
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
            entry._rows.column(name)[entry._row] = slot + 1

    def pop(self, name: str, *default: int | None) -> int | None:
        slot = self.get(name)
        if slot is None:
            if default:
                return default[0]
            raise KeyError(name)
        self._entry._rows.slots[name][self._entry._row] = 0
        return slot

    def __iter__(self) -> Iterator[str]:
        entry = self._entry
        if not entry.live:
            return iter(())
        return iter([name for name, column in entry._rows.slots.items() if column[entry._row]])

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
