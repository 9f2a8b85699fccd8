"""Block keys in numpy arrays: every key has an id (a store slot, a directory row), found by open addressing.

A dict of a million 16-byte keys to small objects costs ~250 bytes a key in
Python objects; here a key costs its 16 bytes, a live flag, and 8-13 bytes of
table (4-byte cells, between 30 % and half full)::

    keys   id 0 | id 1 | id 2 | ...      (lo, hi) uint64 pairs: the digest's two halves
    live   1      0      1               ids in use
    cells  [ 0  3  0  0  1  0  ...]      id + 1 where a key's probe sequence stops; 0 empty, -1 gone

A key's probe starts at a Fibonacci hash of its halves, scaled to the table's
size (any size: a rebuilt table is 30 % full, where a power of two would leave
it anywhere from an eighth to a quarter full), and walks forward to the first
empty cell, going on from the last cell to the first. `find_many` walks every
key of a batch at once (a read's hundreds of keys in a few numpy passes);
`find` walks one in Python, through memoryviews of the arrays (plain ints, no
numpy scalars). Removal leaves a "gone" cell so later keys of the chain are
still found; the table is rebuilt (vectorised) when live and gone cells pass
half of it. A 526-key batch among a million keys takes ~70 us at 30 %, ~60 at
23 %, ~190 at 47 % (the runs lengthen).

A read asks for the same keys several times (where they are, what to load,
what arrived, what to pin), and again at the next step. The last few batches'
answers are kept until the table next changes (a tuple comparison answers
them), and keys found lately are remembered in a dict (key -> id, at most
``_HOT_KEYS``), which answers a batch of 64 in ~3 us where the probe walk costs
~40. The dict stays exact through changes: an id changes only when its key is
removed, and `remove` forgets that key there too.

The caller owns the ids: it adds a key under an id that is not live and
removes ids. Keys must be unique (`add` of a key already present under another
id is the caller's error; see tierkv.tiers.journal and tierkv.manager.directory).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import compress, repeat

import numpy as np

from tierkv.keys import KEY_BYTES

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_EMPTY, _GONE = 0, -1
_MIN_CELLS = 1024
_FILL = 0.3          # a rebuilt table is this full; it is rebuilt again past half
_RECENT = 4          # batches whose answers are kept until the table next changes
_HOT_KEYS = 1 << 16  # keys found lately, remembered (~8 MB at most; then the memory starts again)
_HOT_BATCH = 8192    # a batch larger than this (a store's million keys) is not remembered
_SCALAR_BELOW = 12   # batches smaller than this are looked up key by key (numpy's per-call cost)


def split(keys: Sequence[bytes]) -> np.ndarray:
    """16-byte keys as an (n, 2) array of their little-endian uint64 halves."""
    if not len(keys):
        return np.empty((0, 2), np.uint64)
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)


def widen(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with ``rows`` rows, the new ones zero. The OS commits the zero pages of a large
    array only when they are written, so room for growth costs no memory until used."""
    grown = np.zeros((rows, *array.shape[1:]), array.dtype)
    grown[:len(array)] = array
    return grown


class KeyTable:
    def __init__(self, ids: int = 0) -> None:
        """``ids``: room for ids 0..ids-1 before the arrays first grow."""
        self.keys = np.zeros((max(ids, 16), 2), np.uint64)
        self.live = np.zeros(max(ids, 16), bool)
        self._live_view = memoryview(self.live)
        self._count = 0
        self._gone = 0
        self._version = 0    # bumped by every change: batches answered before it are stale
        self._recent: list[tuple[int, tuple[bytes, ...], np.ndarray]] = []
        self._hot: dict[bytes, int] = {}   # key -> id of keys found lately; exact (see `remove`)
        self._size_for(max(ids, 1))

    # -- queries ------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.find(key) >= 0

    def find(self, key: bytes) -> int:
        """The id of ``key``, or -1."""
        id = self._hot.get(key)
        if id is None:
            id = self._walk(key)
            if id >= 0:
                self._remember((key,), (id,))
        return id

    def find_many(self, keys: Sequence[bytes] | np.ndarray, *, remember: bool = True) -> np.ndarray:
        """The id of each key (int64; -1 where absent). ``keys``: bytes, or their `split` halves.

        Batches and keys asked for lately are answered from memory; the other keys walk their probe
        sequences together, a numpy pass per step, until few are left, and those walk on one by one.
        ``remember=False``: a lookup from a thread other than the one that changes the table, which
        reads the memories but never writes them (an answer written while a change removed its key
        would outlive the change)."""
        if isinstance(keys, np.ndarray):
            return self._find_many(keys)
        if len(keys) < _SCALAR_BELOW:
            one = self.find if remember else self._peek
            return np.fromiter(map(one, keys), np.int64, count=len(keys))
        if len(keys) > _HOT_BATCH:   # a store's million keys: not worth remembering
            return self._find_many(split(keys))
        version, asked = self._version, tuple(keys)   # the version first: a change meanwhile makes it stale
        for seen, recent, found in self._recent:
            if seen == version and recent == asked:
                return found.copy()
        found = self._find_hot(keys, remember)
        if remember:
            self._recent = [(version, asked, found), *self._recent[:_RECENT - 1]]
        return found.copy()

    def note(self, keys: Sequence[bytes], ids: np.ndarray) -> None:
        """Remember ``ids`` as the answer to a `find_many` of ``keys`` (found another way, e.g. hinted and
        checked by `find_hinted`) until the table next changes; batches `find_many` answers from
        memory only."""
        if _SCALAR_BELOW <= len(keys) <= _HOT_BATCH:
            self._recent = [(self._version, tuple(keys), ids.copy()), *self._recent[:_RECENT - 1]]

    def _peek(self, key: bytes) -> int:
        """`find` that remembers nothing."""
        id = self._hot.get(key)
        return self._walk(key) if id is None else id

    def _walk(self, key: bytes) -> int:
        """``key``'s id by its probe sequence (-1: absent)."""
        return self._find(int.from_bytes(key[:8], "little"), int.from_bytes(key[8:KEY_BYTES], "little"))

    def _find_hot(self, keys: Sequence[bytes], remember: bool = True) -> np.ndarray:
        found = np.array(list(map(self._hot.get, keys, repeat(-2, len(keys)))), np.int64)
        if not len(found) or found.min() > -2:
            return found
        miss = np.flatnonzero(found == -2)
        asked = [keys[i] for i in miss.tolist()]
        ids = self._find_many(split(asked))
        found[miss] = ids
        if remember:
            known = ids >= 0
            self._remember(compress(asked, known.tolist()), ids[known].tolist())
        return found

    def _remember(self, keys: Iterable[bytes], ids: Iterable[int]) -> None:
        if len(self._hot) >= _HOT_KEYS:
            self._hot.clear()
        self._hot.update(zip(keys, ids))

    def _find_many(self, halves: np.ndarray) -> np.ndarray:
        found = np.full(len(halves), -1, np.int64)
        if not len(halves) or not self._count:
            return found
        pending, at = np.arange(len(halves)), self._home(halves)
        flat = self.keys.reshape(-1)
        while len(pending) >= _SCALAR_BELOW:   # a numpy pass per probe step while enough keys walk on
            ids = self._cells.take(at).astype(np.int64) - 1      # -1: empty, -2: gone
            hit = (ids >= 0) & (flat.take(2 * ids) == halves[pending, 0]) & (flat.take(2 * ids + 1) == halves[pending, 1])
            found[pending[hit]] = ids[hit]
            walk = ~hit & (ids != -1)   # the cell held another key (or a gone one): try the next
            pending, at = pending[walk], at[walk] + 1
            at[at == self._size] = 0
        for i, (lo, hi) in zip(pending.tolist(), halves[pending].tolist()):
            found[i] = self._find(lo, hi)
        return found

    def _find(self, lo: int, hi: int) -> int:
        cells, keys, size = self._cells_view, self._keys_view, self._size
        at = self._start(lo, hi)
        while True:
            cell = cells[at]
            if cell == _EMPTY:
                return -1
            if cell > 0 and keys[2 * cell - 2] == lo and keys[2 * cell - 1] == hi:
                return cell - 1
            at = at + 1 if at + 1 < size else 0

    def key(self, id: int) -> bytes:
        return self.keys[id].tobytes()

    def find_hinted(self, halves: np.ndarray, hints: np.ndarray) -> np.ndarray:
        """`find_many` of ``halves`` where ``hints`` [n] guess each key's id (-1: no guess): a guess
        whose id is live under that key is taken as it is (two array takes and compares, no hashing),
        the other keys are looked up."""
        ids = np.asarray(hints, np.int64)
        good = self.holding(halves, ids)
        if good.all():
            return ids.copy()
        found = np.where(good, ids, -1)
        wrong = np.flatnonzero(~good)
        found[wrong] = self._find_many(halves[wrong])
        return found

    def holding(self, halves: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Whether each of ``ids`` is live under the key in the same row of ``halves`` (two array takes
        and compares, no hashing): a check of ids found earlier, which a change may have given away."""
        ids = np.asarray(ids, np.int64)
        inside = (ids >= 0) & (ids < len(self.live))
        at = np.where(inside, ids, 0)
        return inside & self.live[at] & (self.keys[at, 0] == halves[:, 0]) & (self.keys[at, 1] == halves[:, 1])

    def ids(self) -> np.ndarray:
        """The live ids, in order."""
        return np.flatnonzero(self.live)

    # -- changes -----------------------------------------------------------
    def add(self, key: bytes, id: int) -> None:
        """File ``key`` (not present) under ``id`` (not live)."""
        self._reserve_ids(id + 1)
        self._version += 1
        lo = int.from_bytes(key[:8], "little")
        hi = int.from_bytes(key[8:KEY_BYTES], "little")
        self._keys_view[2 * id], self._keys_view[2 * id + 1] = lo, hi
        self._live_view[id] = True
        self._count += 1
        if 2 * (self._count + self._gone) > len(self._cells):
            self._rebuild()
            return
        cells, size = self._cells_view, self._size
        at = self._start(lo, hi)
        while cells[at] > 0:
            at = at + 1 if at + 1 < size else 0
        if cells[at] == _GONE:
            self._gone -= 1
        cells[at] = id + 1

    def add_many(self, halves: np.ndarray, ids: np.ndarray) -> None:
        """`add` of each (key halves, id) pair, at once."""
        if not len(ids):
            return
        self._reserve_ids(int(ids.max()) + 1)
        self._version += 1
        self.keys[ids] = halves
        self.live[ids] = True
        self._count += len(ids)
        if 2 * (self._count + self._gone) > len(self._cells):
            self._rebuild()
        else:
            self._place(ids)

    def remove(self, id: int) -> None:
        """Forget the key of ``id`` (live)."""
        lo, hi = (int(half) for half in self.keys[id])
        at, size = self._start(lo, hi), self._size
        while self._cells_view[at] != id + 1:
            at = at + 1 if at + 1 < size else 0
        self._cells[at] = _GONE
        self._hot.pop(self.keys[id].tobytes(), None)
        self._version += 1
        self.live[id] = False
        self._count -= 1
        self._gone += 1

    def nbytes(self) -> int:
        return sum(self.nbytes_parts().values())

    def nbytes_parts(self) -> dict[str, int]:
        """The bytes of each array: the keys, their live flags, the hash cells."""
        return {"keys": self.keys.nbytes, "live flags": self.live.nbytes, "hash cells": self._cells.nbytes}

    @property
    def fill(self) -> float:
        """The share of hash cells in use (a rebuilt table is 30 % full; it is rebuilt past half)."""
        return (self._count + self._gone) / len(self._cells)

    # -- inside ------------------------------------------------------------
    def _start(self, lo: int, hi: int) -> int:
        """The first cell of a key's probe: `_home` of one key, in Python ints."""
        return (((((lo ^ hi) * _GOLDEN) & _MASK64) >> 32) * self._size) >> 32

    def _home(self, halves: np.ndarray) -> np.ndarray:
        """The first cell of each key's probe: the top 32 bits of a Fibonacci hash scaled to the table
        (a multiply and a shift where a power-of-two table masks: the table can be any size)."""
        mixed = (halves[:, 0] ^ halves[:, 1]) * np.uint64(_GOLDEN)   # wraps modulo 2**64, as intended
        return (((mixed >> np.uint64(32)) * np.uint64(self._size)) >> np.uint64(32)).view(np.int64)

    def _place(self, ids: np.ndarray) -> None:
        """Put ``ids`` (live, not in the table) into their keys' first free cells."""
        pending, at = ids, self._home(self.keys[ids])
        while len(pending):
            cells = self._cells[at]
            free = cells <= 0
            taken, first = np.unique(at[free], return_index=True)   # one id per free cell this pass
            self._gone -= int(np.count_nonzero(self._cells[taken] == _GONE))
            self._cells[taken] = pending[free][first] + 1
            placed = np.zeros(len(pending), bool)
            placed[np.flatnonzero(free)[first]] = True
            pending, at = pending[~placed], at[~placed] + 1
            at[at == self._size] = 0

    def _rebuild(self) -> None:
        self._size_for(self._count)
        self._place(self.ids())

    def _size_for(self, count: int) -> None:
        self._size = max(_MIN_CELLS, math.ceil(count / _FILL))
        self._cells = np.zeros(self._size, np.int32)
        self._gone = 0
        self._cells_view = memoryview(self._cells)
        self._keys_view = memoryview(self.keys).cast("B").cast("Q")

    def _reserve_ids(self, n: int) -> None:
        if n <= len(self.live):
            return
        grown = max(n, 2 * len(self.live))
        self.keys, self.live = widen(self.keys, grown), widen(self.live, grown)
        self._keys_view = memoryview(self.keys).cast("B").cast("Q")
        self._live_view = memoryview(self.live)
