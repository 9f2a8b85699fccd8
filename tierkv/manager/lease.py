"""A lease: blocks pinned in memory tiers for one caller, until it releases them."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.keys import BlockKey
from tierkv.tiers.base import Tier


@dataclass(slots=True)
class Lease:
    """Blocks pinned for a caller: ``views[i]`` holds ``keys[i]``. Release exactly once."""

    keys: tuple[BlockKey, ...]
    places: tuple[tuple[str, int], ...]   # (tier, slot) per key
    tiers: Mapping[str, Tier]
    unpin: Callable[[Iterable[tuple[str, int]]], None]
    released: bool = False
    _views: tuple[torch.Tensor, ...] | None = None

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """One tensor per key, made on first use (a caller that gathers by ``places`` needs none)."""
        if self._views is None:
            self._views = tuple(self.tiers[name].view(slot) for name, slot in self.places)
        return self._views

    def in_place(self) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray] | None:
        """The blocks where they lie, to be read in place until the lease is released: buffers [n,
        block_bytes] (the extents of host tiers), and per key its buffer's position in that list and
        its row there. None where a block is in device memory, or behind a modelled link (a CXL pool
        charges its link per copy): read those through a copy."""
        names = {name for name, _ in self.places}
        if not all(host_arena(self.tiers[name]) for name in names):
            return None
        buffers: list[torch.Tensor] = []
        part = np.empty(len(self.places), dtype=np.int64)
        rows = np.empty(len(self.places), dtype=np.int64)
        for name in names:
            at = [i for i, (tier, _) in enumerate(self.places) if tier == name] if len(names) > 1 \
                else slice(None)
            extents, extent, offset = self.tiers[name].locate_many(
                [slot for tier, slot in self.places if tier == name])
            part[at], rows[at] = extent + len(buffers), offset
            buffers += extents
        return buffers, part, rows

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.unpin(self.places)


def host_arena(tier: Tier) -> bool:
    """``tier`` keeps its blocks in host memory that a reader may use directly."""
    return getattr(tier, "device", None) == torch.device("cpu") and hasattr(tier, "locate_many") \
        and getattr(tier, "reads_in_place", True)
