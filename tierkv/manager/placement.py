"""Placement decisions as pure functions of the directory and the tiers: no await, no state change.

The tier manager asks these and acts on the answers::

    question                               answer                     rule
    which tiers may a put use?             put_order, put_attempts    a free slot anywhere beats evicting
    which tiers does a reader read in?     memory_tiers, in_place     a modelled pool only if nothing else
    where does a load copy from?           load_source                the fastest tier holding the block
    may a policy pick this block?          evictable / Unevictable    never pinned, wanted, or a last copy
    a victim: demote it or drop it?        split_victims              keep warm copies while the tier
                                                                      below has room; never lose the only
                                                                      copy of a protected block

Tiers are ordered fastest first; the store (NVMe) is last when there is one.
"""
from __future__ import annotations

from collections.abc import Container, Hashable, Mapping, Sequence
from itertools import compress, repeat
from operator import not_

import numpy as np

from tierkv.keys import BlockKey
from tierkv.manager.directory import Directory
from tierkv.manager.rows import BlockEntry
from tierkv.tiers.base import Medium, Tier


# -- where blocks go --------------------------------------------------------------
def put_order(tier: str | None, order: Sequence[str]) -> list[str]:
    """The tiers a new block may go to: the one asked for, else every tier, fastest first."""
    if tier is None:
        return list(order)
    if tier not in order:
        raise ValueError(f"tier={tier!r}: not configured; tiers: {', '.join(order)}")
    return [tier]


def put_attempts(order: Sequence[str], tiers: Mapping[str, Tier], blocks: int = 1) -> list[tuple[str, int]]:
    """Where a put of ``blocks`` new blocks tries to place the next of them, in turn, and how many:
    the first tier of ``order`` with free slots alone, as many as fit there (a free slot anywhere
    beats evicting from the fastest tier); else every tier of ``order``, each making room for as many
    as it holds."""
    free = next((n for n in order if tiers[n].pool.free), None)
    if free is not None:
        return [(free, min(blocks, tiers[free].pool.free))]
    return [(n, max(1, min(blocks, tiers[n].pool.capacity))) for n in order]   # 0 slots: reserve says why


def memory_tiers(order: Sequence[str], tiers: Mapping[str, Tier]) -> list[str]:
    """The tiers a block can be read in: all but the store."""
    return [n for n in order if tiers[n].medium is not Medium.NVME]


def in_place_tiers(order: Sequence[str], tiers: Mapping[str, Tier]) -> list[str]:
    """Memory tiers a reader may use in place. A pool behind a modelled link is not one (reading its
    views would bypass the model) unless no other memory tier exists."""
    memory = memory_tiers(order, tiers)
    direct = [n for n in memory if getattr(tiers[n], "reads_in_place", True)]
    return direct or memory


def load_source(entry: BlockEntry, order: Sequence[str]) -> str | None:
    """The tier a move copies ``entry`` from: the first of ``order`` holding it."""
    return next(filter(entry.copies.__contains__, order), None)


def tier_below(order: Sequence[str], name: str) -> str | None:
    index = order.index(name)
    return order[index + 1] if index + 1 < len(order) else None


# -- what may leave a tier ----------------------------------------------------------
def evictable(key: BlockKey, name: str, directory: Directory, tiers: Mapping[str, Tier],
              order: Sequence[str]) -> bool:
    """Whether ``name``'s policy may choose ``key``: not pinned there, not wanted there by a waiting
    reader, and not the last copy of a protected block in the last tier (a key stale in the policy
    may go: evicting it is harmless)."""
    return key not in Unevictable(name, directory, tiers, order)


class Unevictable(Container[Hashable]):
    """The keys a tier's policy must not choose (``evict(n, protected)``), checked lazily per candidate."""

    def __init__(self, name: str, directory: Directory, tiers: Mapping[str, Tier], order: Sequence[str]) -> None:
        self._name, self._guard, self._wanted = name, directory.guard, directory.wanted
        self._directory, self._pins_of = directory, tiers[name].pool.pins_of
        self._pins, self._last = tiers[name].pool.pins, tier_below(order, name) is None
        # a shared store's blocks in other live processes' slots: evicting one here frees no room
        self._may_free = getattr(tiers[name].pool, "may_free", None)

    def screen(self, keys: Sequence[BlockKey]) -> list[bool]:
        """``key in self`` for each of ``keys``, in one lookup (a policy's batch of candidates)."""
        holders, copies, slots = self._directory.guards(keys, self._name)
        here = slots >= 0
        pinned = np.zeros(len(keys), bool)
        pinned[here] = self._pins_of(slots[here]) > 0
        if self._may_free is not None:
            pinned[here] |= ~self._may_free(slots[here])
        out = pinned | (here & self._last & (holders > 0) & (copies == 1))
        if self._wanted:   # (a key is in ``wanted`` only while its count is above 0)
            asked = map(self._wanted.__contains__, zip(keys, repeat(self._name)))
            out |= here & np.fromiter(asked, bool, count=len(keys))
        return out.tolist()

    def __contains__(self, key: object) -> bool:
        """Not `evictable`; its lookups are bound once (this runs for every candidate a policy offers)."""
        state = self._guard(key, self._name)  # type: ignore[arg-type]
        if state is None or state[0] < 0:
            return False
        slot, holders, copies = state
        if self._pins(slot) or (self._wanted and self._wanted.get((key, self._name))):
            return True
        if self._may_free is not None and not self._may_free(np.array([slot]))[0]:
            return True
        return self._last and holders > 0 and copies == 1


def room_below(name: str, order: Sequence[str], tiers: Mapping[str, Tier]) -> int:
    """Free slots in the memory tier under ``name`` (a demotion to the store costs a write: none)."""
    below = tier_below(order, name)
    if below is None or tiers[below].medium is Medium.NVME:
        return 0
    return tiers[below].pool.free


def split_victims(victims: Sequence[BlockKey], name: str, directory: Directory,
                  order: Sequence[str], room: int) -> tuple[list[BlockKey], list[BlockKey]]:
    """(demote, drop) of the blocks a policy chose to leave ``name``.

    A victim moves down when it holds the only copy of a protected block, or, while the memory
    below has ``room``, when the tier below has no copy (a warm copy is cheaper than a reload).
    The others are dropped from ``name``: another tier holds them, or nobody needs them kept.
    """
    below = tier_below(order, name)
    demote: list[BlockKey] = []
    drop: list[BlockKey] = []
    holders, copies, below_has = directory.counts(victims, below)
    if not room:    # no memory below (the store is next, or the tier under is full): last copies go down
        only = ((copies == 1) & (holders > 0)).tolist() if below is not None else [False] * len(victims)
        return list(compress(victims, only)), list(compress(victims, map(not_, only)))
    for key, held, n, has in zip(victims, holders.tolist(), copies.tolist(), below_has.tolist()):
        only_copy = n == 1 and held > 0 and below is not None
        if only_copy or (len(demote) < room and not has):
            demote.append(key)
        else:
            drop.append(key)
    return demote, drop
