"""The NVMe store's index: which key lives in which slot, with its checksum, in arrays.

Built by replaying the journal (`tierkv.tiers.journal.replay`) and kept up to date by the
store's writes and by what other processes journal (`tierkv.tiers.nvme_view`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierkv.keys import BlockKey
from tierkv.keytable import KeyTable, split, widen


@dataclass(slots=True)
class Entry:
    slot: int
    checksum: int


class Index:
    """Key -> (slot, checksum), one key per slot: a later PUT for a slot evicts its old key.

    Kept in arrays by slot (a `KeyTable` whose ids are the slots, and each slot's checksum):
    ~38 bytes a block, where a dict of digests to entries took ~260. Replaying a million
    records builds no Python object per record (`replay`).
    """

    __slots__ = ("_table", "_sums")

    def __init__(self) -> None:
        self._table = KeyTable()
        self._sums = np.zeros(len(self._table.live), np.uint64)

    def get(self, key: BlockKey | bytes) -> Entry | None:
        slot = self._table.find(key)
        return None if slot < 0 else Entry(slot, int(self._sums[slot]))

    def find_many(self, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each key (-1 where absent) and its checksum, in one vectorised pass."""
        slots = self._table.find_many(keys)
        return slots, self._sums[np.maximum(slots, 0)]

    def holder(self, slot: int) -> bytes | None:
        """The digest of the key that lives in ``slot``, if any."""
        live = self._table.live
        return self._table.key(slot) if 0 <= slot < len(live) and live[slot] else None

    def items(self) -> list[tuple[BlockKey, Entry]]:
        return [(key, Entry(slot, checksum)) for key, slot, checksum in zip(*self.records())]

    def keys_and_slots(self) -> tuple[list[BlockKey], list[int]]:
        """Every key and its slot, by slot."""
        return self.records()[:2]

    def records(self) -> tuple[list[BlockKey], list[int], list[int]]:
        """Every key, its slot and its checksum, by slot (three lists, no object per block)."""
        slots = self._table.ids()
        return BlockKey.many(self._table.keys[slots].tobytes()), slots.tolist(), self._sums[slots].tolist()

    def slots(self) -> list[int]:
        return self._table.ids().tolist()

    def slot_array(self) -> np.ndarray:
        return self._table.ids()

    def __len__(self) -> int:
        return len(self._table)

    def nbytes(self) -> int:
        return self._table.nbytes() + self._sums.nbytes

    def put(self, digest: bytes, slot: int, checksum: int) -> None:
        self.drop(digest)
        evicted = self.holder(slot)
        if evicted is not None:
            self._table.remove(slot)
        self._table.add(digest, slot)
        self._fit()
        self._sums[slot] = checksum

    def put_many(self, digests: Sequence[bytes], slots: Sequence[int],
                 checksums: Sequence[int]) -> list[tuple[bytes, int, int]]:
        """`put` of each, in order; in a few vectorised passes when keys and slots are distinct (a
        write batch's are). Returns the entries of keys that moved: (digest, old slot, checksum)."""
        halves, at = split(digests), np.asarray(slots, np.int64)
        before = self._table.find_many(halves)
        moved = [(digest, slot, int(self._sums[slot])) for digest, slot, new in
                 zip(digests, before.tolist(), at.tolist()) if slot >= 0 and slot != new]
        if len(set(digests)) < len(digests) or len(set(slots)) < len(slots):
            for digest, slot, checksum in zip(digests, slots, checksums):
                self.put(digest, slot, checksum)
            return moved
        live = self._table.live
        taken = at[at < len(live)]
        for old in set(before[before >= 0].tolist()) | set(taken[live[taken]].tolist()):
            self._table.remove(old)
        self._table.add_many(halves, at)
        self._fit()
        self._sums[at] = np.asarray(checksums, np.uint64)
        return moved

    def load(self, halves: np.ndarray, slots: np.ndarray, checksums: np.ndarray) -> None:
        """Fill an empty index with distinct keys (their `split` halves) in distinct slots."""
        self._table.add_many(halves, slots)
        self._fit()
        self._sums[slots] = checksums

    def drop(self, digest: bytes, slot: int | None = None) -> bool:
        """Forget the key (only if it lives in ``slot``, when given); whether it was there."""
        found = self._table.find(digest)
        if found < 0 or (slot is not None and found != slot):
            return False
        self._table.remove(found)
        return True

    def _fit(self) -> None:
        """Room in the checksums for every slot the table has room for."""
        if len(self._table.live) > len(self._sums):
            self._sums = widen(self._sums, len(self._table.live))
