"""A read made on the caller's thread, with no hop to the manager's loop and no pin
(``BlockingTierManager.read(..., pin=False)``): the sparse engine's read of a layer's pages.

The directory and the host tiers are read while the loop may change them; what makes that safe is
checked after the fact: a pool's ``epoch`` (a slot freed since the lookup) for a block lent where it
lies (``Lent``), each slot's ``generation`` for a block copied or lent among others (``Watched``).
Where a check cannot be made, or fails, the caller gets None and makes the pinned read.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey
from tierkv.manager.lease import Lent, Watched, lends_in_place
from tierkv.manager.read_future import ReadFuture

if TYPE_CHECKING:
    from tierkv.manager.blocking import BlockingTierManager


def read_unpinned(facade: BlockingTierManager, keys: Sequence[BlockKey], into: torch.Tensor, tier: str | None,
                  layer: int | None, rows: np.ndarray | None, *, lend: bool, packed: bool) -> ReadFuture | None:
    """``read(..., pin=False)`` done here, or None where it cannot be (see ``read``). The directory
    is read while the loop may change it: whatever it changes under the lookup either leaves the
    blocks where they were found or frees a slot of their tier first, which bumps its pool's
    ``epoch`` (``Lent``), or gives a block's row to another block, which the lookup checks after
    reading the row's slots (`Directory.slots_and_rows`)."""
    mgr = facade.manager
    if facade._closed or mgr.access is not None or mgr.directory.cold or not keys or not mgr.in_place_tiers:
        return None     # (a guessed block's first read tells its policy: the loop's read does that)
    names = [tier] if tier is not None else mgr.in_place_tiers
    hosts = [mgr.tiers[name] for name in names]
    if not all(map(lends_in_place, hosts)):
        return None
    epochs = [host.pool.epoch for host in hosts]
    try:
        slots, rows = mgr.directory.slots_and_rows(keys, names[0], rows, off_loop=True)
        if lend and slots.min() >= 0:        # all in the first tier: lent where they lie, or not at all
            where = hosts[0].locate_many(slots)
            if where is None or hosts[0].pool.epoch != epochs[0]:
                return None
            facade._used.append((names[0], keys))       # its policy hears of the use on the loop
            future = ReadFuture(facade, into, list(range(len(keys))), [], None, tier, layer)
            future.lease = Lent(tuple(keys), hosts[0].pool, epochs[0],
                                functools.partial(facade._record_hits, [(names[0], len(keys))], layer))
            future.extent, future.rows = where, rows
            return future
        if not packed:
            return None
        found = [slots] + [mgr.directory.slots_and_rows(keys, name, rows, off_loop=True)[0] for name in names[1:]]
    except (BlockMissing, IndexError):   # unknown keys, or a lookup that raced a change
        return None
    return _copy_unpinned(facade, keys, into, tier, layer, rows, names, found, epochs, lend=lend)

def _copy_unpinned(facade: BlockingTierManager, keys: Sequence[BlockKey], into: torch.Tensor, tier: str | None,
                   layer: int | None, rows: np.ndarray, names: list[str], found: list[np.ndarray],
                   epochs: list[int], *, lend: bool) -> ReadFuture | None:
    """The packed read of ``read_unpinned`` where not every block is in the first tier: the blocks
    none holds start loading, then each other block is copied from the first of ``names`` holding it
    (``found``: its slot in each); None where none is missing (the pinned read copies those) or a
    slot was freed. ``lend``, where every memory tier lies in one ``HostSpace``: nothing is copied;
    the future lends the blocks where they lie (``ReadFuture.extent``, rows of the space; -1: still
    loading) and its ``lease`` is a ``Watched`` one, the loading ones too once they arrive.

    The load goes first, so its preparation on the loop overlaps the copies here. Its evictions
    free slots of the tiers copied from, so the copies are checked by their own slots'
    ``generations``, noted before it is sent (and at the lookup's epochs: nothing freed between);
    the blocks copied are touched before it, so their policies keep them.
    """
    mgr = facade.manager
    where = np.full(len(keys), -1)
    for i, slots in reversed(list(enumerate(found))):   # the first tier holding a block wins
        where[slots >= 0] = i
    missing = np.flatnonzero(where < 0)
    space = facade.space if lend else None
    if not len(missing) and space is None:
        return None
    order = np.argsort(where, kind="stable")            # missing (-1) first, then a run per tier
    placed = np.empty(len(keys), np.int64)
    placed[np.concatenate((order[len(missing):], order[:len(missing)]))] = np.arange(len(keys))
    copied = [(i, mine, found[i][mine]) for i in range(len(names)) if len(mine := np.flatnonzero(where == i))]
    pools = [mgr.tiers[names[i]].pool for i, _, _ in copied]
    if any(pool.generations is None for pool in pools):
        return None     # a tier whose pool counts no frees: the pinned read
    noted = [pool.generations[slots] for pool, (_, _, slots) in zip(pools, copied)]
    if any(pool.epoch != epochs[i] for pool, (i, _, _) in zip(pools, copied)):
        return None     # a slot was freed since the lookup: it may hold another block now
    for i, mine, _ in copied:
        facade._used.append((names[i], [keys[j] for j in mine.tolist()]))   # touched before the load's evictions
    loading = [keys[j] for j in missing.tolist()]
    pending = asyncio.run_coroutine_threadsafe(
        facade._after_releases(mgr.load_missing(loading, tier, layer=layer, rows=rows[missing])), facade._loop) \
        if len(loading) else None
    future = ReadFuture(facade, into, np.flatnonzero(where >= 0).tolist(), missing.tolist(), pending, tier, layer)
    future.placed, future.rows = placed, rows
    if space is not None:
        try:
            at = np.full(len(keys), -1, np.int64)
            for i, mine, slots in copied:
                at[mine] = mgr.tiers[names[i]].space_rows(slots)
            future.extent = space.rows(), at
        except BaseException:
            future.cancel()
            raise
        hits = [(names[i], len(mine)) for i, mine, _ in copied]
        future.lease = Watched(tuple(keys), tuple((pool, slots, gens) for pool, (_, _, slots), gens
                                                  in zip(pools, copied, noted)),
                               functools.partial(facade._record_hits, hits, layer))
        return future
    try:
        for i, mine, slots in copied:
            mgr.tiers[names[i]].gather(slots.tolist(), into, placed[mine].tolist())
    except BaseException:
        future.cancel()
        raise
    if any((pool.generations[slots] != gens).any() for pool, (_, _, slots), gens in zip(pools, copied, noted)):
        future.cancel()
        return None     # a slot copied from was freed meanwhile: what was copied may be another block's
    for i, mine, _ in copied:
        mgr.record_hits(names[i], len(mine), layer)
    return future
