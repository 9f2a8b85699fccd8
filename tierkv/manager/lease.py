"""A lease: blocks pinned in memory tiers for one caller, until it releases them."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

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

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.unpin(self.places)
