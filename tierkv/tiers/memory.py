"""An arena of fixed-size slots in memory: what the gpu, cpu and cxl tiers share.

The arena grows in extents as slots are first used and never beyond the
budget, so a large budget costs nothing until blocks arrive::

    slot:    0 1 2 3 | 4 5 6 7 | 8 9 .      (extent_slots = 4)
    extent:  [  0    ] [  1    ] [ 2 ...
    view(s) = extents[s // extent_slots][s % extent_slots]

Host extents start on a 4096-byte boundary so the NVMe tier can read and
write them with O_DIRECT without a bounce buffer.
"""
from __future__ import annotations

import threading

import torch

from tierkv.device import host_buffer
from tierkv.tiers.base import Medium
from tierkv.tiers.pool import BlockPool

EXTENT_BYTES = 64 * 1024**2


class MemoryTier:
    """Slots of ``block_bytes`` in memory on ``device``, at most ``budget`` bytes of them."""

    def __init__(self, name: str, medium: Medium, device: torch.device, block_bytes: int,
                 budget: int, *, pinned: bool = False) -> None:
        self.name = name
        self.medium = medium
        self.device = device
        self.block_bytes = block_bytes
        self.pinned = pinned
        self.pool = BlockPool(budget // block_bytes)
        self.extent_slots = max(1, min(self.pool.capacity, EXTENT_BYTES // block_bytes))
        self._extents: list[torch.Tensor] = []
        self._grow_lock = threading.Lock()

    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    @property
    def allocated_bytes(self) -> int:
        return sum(extent.numel() for extent in self._extents)

    def view(self, slot: int) -> torch.Tensor:
        if not 0 <= slot < self.pool.capacity:
            raise IndexError(f"slot={slot}: outside 0..{self.pool.capacity - 1} of tier {self.name}")
        index, offset = divmod(slot, self.extent_slots)
        if index >= len(self._extents):
            self._grow(index)
        start = offset * self.block_bytes
        return self._extents[index][start:start + self.block_bytes]

    def close(self) -> None:
        self._extents.clear()

    def _grow(self, index: int) -> None:
        with self._grow_lock:
            while len(self._extents) <= index:
                first = len(self._extents) * self.extent_slots
                slots = min(self.extent_slots, self.pool.capacity - first)
                self._extents.append(self._allocate(slots * self.block_bytes))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_buffer(nbytes, pinned=self.pinned)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
