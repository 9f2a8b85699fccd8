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

    def in_place(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """Where the blocks lie, to be read in place until the lease is released: the one extent
        [slots, block_bytes] of a host tier holding them all, and each key's row in it. None where they
        lie in several tiers or extents, in device memory, or behind a modelled link (a CXL pool
        charges its link per copy): copy those out."""
        names = {name for name, _ in self.places}
        if len(names) != 1:
            return None
        tier = self.tiers[names.pop()]
        if getattr(tier, "device", None) != torch.device("cpu") or not hasattr(tier, "locate_many") \
                or not getattr(tier, "reads_in_place", True):
            return None
        return tier.locate_many([slot for _, slot in self.places])

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.unpin(self.places)
