"""A lease: blocks pinned in memory tiers for one caller, until it releases them; or lent unpinned,
checked when released (``Lent``: no slot of the tier freed; ``Watched``: none of theirs)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
import torch

from tierkv.keys import BlockKey
from tierkv.tiers.base import Tier
from tierkv.tiers.memory import HostSpace


def lends_in_place(tier: Tier) -> bool:
    """Whether a caller may read ``tier``'s blocks where they lie: host memory, with no modelled link."""
    return getattr(tier, "device", None) == torch.device("cpu") and hasattr(tier, "locate_many") \
        and getattr(tier, "reads_in_place", True)


def shared_space(tiers: Iterable[Tier]) -> HostSpace | None:
    """The one ``HostSpace`` every tier of ``tiers`` lies in, each lent in place; else None."""
    spaces = {getattr(t, "space", None) if lends_in_place(t) else None for t in tiers}
    return spaces.pop() if len(spaces) == 1 else None


def space_rows(tiers: Mapping[str, Tier], places: Sequence[tuple[str, int]]) -> np.ndarray:
    """Each (tier, slot)'s row of the ``HostSpace`` the tiers share (see `shared_space`)."""
    rows = np.fromiter(map(itemgetter(1), places), np.int64, len(places))
    names = list(map(itemgetter(0), places))
    for name in dict.fromkeys(names):
        mine = np.fromiter(map(name.__eq__, names), bool, len(names))
        rows[mine] = tiers[name].space_rows(rows[mine])
    return rows


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
        [slots, block_bytes] of a host tier holding them all, or the rows of the ``HostSpace`` their
        tiers share, and each key's row in it. None where they lie in several extents or tiers not
        sharing a space, in device memory, or behind a modelled link (a CXL pool charges its link per
        copy): copy those out."""
        names = {name for name, _ in self.places}
        if len(names) > 1:
            space = shared_space(self.tiers[name] for name in names)
            return None if space is None else (space.rows(), space_rows(self.tiers, self.places))
        if not names:
            return None
        tier = self.tiers[names.pop()]
        return tier.locate_many([slot for _, slot in self.places]) if lends_in_place(tier) else None

    def release(self) -> bool:
        """Unpin the blocks; True (what was read through a pinned lease is what was asked for)."""
        if not self.released:
            self.released = True
            self.unpin(self.places)
        return True


@dataclass(slots=True, eq=False)
class Lent:
    """Blocks lent where they lie, unpinned (``BlockingTierManager.read(..., lend=True, pin=False)``):
    found without a hop to the manager's loop, so nothing keeps them in their slots while they are
    read. A slot is only written after it was freed, and freeing any slot of the pool bumps its
    ``epoch`` first, so ``release()`` says whether the rows read are the blocks asked for::

        found at epoch e  ->  read rows  ->  release(): pool.epoch == e ?  True: theirs  False: read again
    """

    keys: tuple[BlockKey, ...]
    pool: object        # the tier's BlockPool
    epoch: int
    kept: Callable[[], None] | None = None    # run once, by the first release() that finds them put

    def release(self) -> bool:
        """Whether the blocks stayed put until now: no slot of the tier was freed since they were found
        (False: what was read may be another block's)."""
        return _checked(self, self.pool.epoch == self.epoch)


@dataclass(slots=True, eq=False)
class Watched:
    """Blocks lent where they lie, unpinned, in one or more tiers, each slot's generation noted when it
    was found (`tierkv.tiers.pool.BlockPool.release_many`): ``release()`` says whether none of those
    slots was freed since, whatever else was (a load running beside the read evicts others)."""

    keys: tuple[BlockKey, ...]
    watched: tuple[tuple[object, np.ndarray, np.ndarray], ...]    # (pool, slots, their generations then)
    kept: Callable[[], None] | None = None    # run once, by the first release() that finds them put

    def release(self) -> bool:
        """Whether every block stayed in its slot until now (False: what was read may be another's)."""
        return _checked(self, all(np.array_equal(pool.generations[slots], noted)
                                  for pool, slots, noted in self.watched))


def _checked(lent: Lent | Watched, put: bool) -> bool:
    """``put``, having run the lease's ``kept`` the first time it is true (the reads it lent count as hits
    only once they are known to be the blocks asked for: a failed check reads them again, pinned)."""
    if put and lent.kept is not None:
        kept, lent.kept = lent.kept, None
        kept()
    return put
