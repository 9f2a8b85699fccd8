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
"""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey


NOTHING_ARRIVING: Mapping[str, asyncio.Future] = MappingProxyType({})
Place = tuple[str, int]   # (tier, slot)


@dataclass(slots=True)
class BlockEntry:
    """One per stored block (a million for a 1M-token prompt in 32-token pages: keep it small)."""
    key: BlockKey
    holders: int = 0            # sequences holding the block; 0: evictable cache
    layer: int | None = None
    index: int | None = None    # block position within its layer (0 = first tokens), when the caller says
    copies: dict[str, int] = field(default_factory=dict)              # tier -> READY slot
    arriving: Mapping[str, asyncio.Future] = field(default_factory=lambda: NOTHING_ARRIVING)  # tier -> move in flight

    @property
    def protected(self) -> bool:
        return self.holders > 0

    def arrive(self, tier: str, done: asyncio.Future) -> None:
        if not self.arriving:
            self.arriving = {}
        self.arriving[tier] = done

    def settle(self, tier: str, done: asyncio.Future) -> None:
        """The move ``done`` into ``tier`` is over (another may have replaced it since)."""
        if self.arriving.get(tier) is done:
            del self.arriving[tier]
            if not self.arriving:
                self.arriving = NOTHING_ARRIVING


class Directory:
    def __init__(self) -> None:
        self._entries: dict[BlockKey, BlockEntry] = {}
        self.wanted: Counter[tuple[BlockKey, str]] = Counter()  # blocks callers wait to pin, per tier
        self.cold: set[tuple[BlockKey, str]] = set()            # guesses inserted cold, not read yet
        self.get: Callable[[BlockKey], BlockEntry | None] = self._entries.get   # the entry of a key, or None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def knows_all(self, keys: Iterable[BlockKey]) -> bool:
        return all(map(self._entries.__contains__, keys))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BlockEntry]:
        return iter(self._entries.values())

    def entry(self, key: BlockKey) -> BlockEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise BlockMissing(f"block {key.hex()} is not stored in any tier", (key,))
        return entry

    def entries(self, keys: Iterable[BlockKey]) -> list[BlockEntry]:
        """`entry` of each key, in one call (a read's hundreds of keys)."""
        found = list(map(self._entries.get, keys))
        if not all(found):     # (not ``None in found``: that compares every entry with None)
            missing = [key for key, entry in zip(keys, found) if entry is None]
            raise BlockMissing(f"block {missing[0].hex()} is not stored in any tier", tuple(missing))
        return found  # type: ignore[return-value]

    def add(self, key: BlockKey, *, hold: bool, layer: int | None = None,
            index: int | None = None) -> BlockEntry:
        """The entry of ``key``, made if new; ``hold``: one more holder."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = BlockEntry(key, 0, layer, index)
        entry.holders += hold
        if layer is not None:
            entry.layer = layer
        if index is not None:
            entry.index = index
        return entry

    def forget_if_empty(self, key: BlockKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and not entry.copies and not entry.arriving:
            del self._entries[key]

    # -- lookups ------------------------------------------------------------
    def tiers_of(self, key: BlockKey, order: Sequence[str]) -> list[str]:
        """The tiers holding a copy of ``key``, in ``order``."""
        entry = self._entries.get(key)
        return [] if entry is None else [n for n in order if n in entry.copies]

    def holds(self, key: BlockKey, names: Sequence[str]) -> bool:
        """Some tier of ``names`` holds a copy of ``key``."""
        entry = self._entries.get(key)
        return entry is not None and any(n in entry.copies for n in names)

    def find(self, keys: Sequence[BlockKey], names: Sequence[str]) -> list[Place | None]:
        """Where each key can be read in place: (tier, slot) in the first of ``names`` holding it, or
        None. The hot path of every read: one dict lookup per key, then one per tier for the keys
        the tiers before it do not hold."""
        entries = list(map(self._entries.get, keys))
        found: list[Place | None] = [None] * len(entries)
        left = range(len(entries))
        for name in names:
            slots = [None if entry is None else entry.copies.get(name) for entry in map(entries.__getitem__, left)]
            for i, slot in zip(left, slots):
                if slot is not None:
                    found[i] = (name, slot)
            left = [i for i, slot in zip(left, slots) if slot is None]
            if not left:
                break
        return found

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
