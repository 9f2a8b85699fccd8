"""The directory: for every block, the slot it holds in each tier.

Blocks are immutable (a key names its content), so copies in several tiers
never disagree; any copy can be dropped while another exists. ``arriving``
holds the move in flight into a tier so that a second reader joins it
instead of loading the block twice. ``protected`` blocks are KV a caller
trusts tierkv with: their last copy is never dropped.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey


NOTHING_ARRIVING: Mapping[str, asyncio.Future] = MappingProxyType({})


@dataclass(slots=True)
class BlockEntry:
    """One per stored block (a million for a 1M-token prompt in 32-token pages: keep it small)."""
    key: BlockKey
    protected: bool
    layer: int | None = None
    index: int | None = None    # block position within its layer (0 = first tokens), when the caller says
    copies: dict[str, int] = field(default_factory=dict)              # tier -> READY slot
    arriving: Mapping[str, asyncio.Future] = field(default_factory=lambda: NOTHING_ARRIVING)  # tier -> move in flight

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

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BlockEntry]:
        return iter(self._entries.values())

    def get(self, key: BlockKey) -> BlockEntry | None:
        return self._entries.get(key)

    def entry(self, key: BlockKey) -> BlockEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise BlockMissing(f"block {key.hex()} is not stored in any tier")
        return entry

    def add(self, key: BlockKey, *, protected: bool, layer: int | None = None,
            index: int | None = None) -> BlockEntry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = BlockEntry(key, protected, layer, index)
        entry.protected |= protected
        if layer is not None:
            entry.layer = layer
        if index is not None:
            entry.index = index
        return entry

    def forget_if_empty(self, key: BlockKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and not entry.copies and not entry.arriving:
            del self._entries[key]
