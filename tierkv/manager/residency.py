"""Residency: a block's copy made or removed in a tier's slot, pins, and what policies and stats hear.

Every change of where a block lives goes through here, so the directory, the
tiers' pools, their eviction policies and the per-tier stats never disagree::

    commit        slot RESERVED -> READY, entry.copies[tier] = slot, policy.insert (or insert_cold)
    remove_copy   entry.copies.pop(tier), the store forgets the block, slot -> FREE
    pin / unpin   a reader holds the slot; its first read of a guessed block is no reuse

All of it is synchronous and runs on the event loop between awaits; the
orchestrator (`tierkv.manager.manager`) decides when.
"""
from __future__ import annotations

import asyncio
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse
from operator import itemgetter

from tierkv.keys import BlockKey
from tierkv.manager.directory import Directory, Place
from tierkv.policy import AdmitsCold, DescribesBlocks, EvictionPolicy, InsertsMany, TouchesMany, implements
from tierkv.tiers.base import Medium, Tier


@dataclass(slots=True)
class TierStats:
    peak_slots: int = 0
    bytes_in: int = 0     # written into the tier
    bytes_out: int = 0    # read out of the tier


class Residency:
    def __init__(self, tiers: Mapping[str, Tier], policies: Mapping[str, EvictionPolicy], directory: Directory,
                 block_bytes: int) -> None:
        self.tiers, self.policies, self.directory, self.block_bytes = tiers, policies, directory, block_bytes
        self.stats = {name: TierStats() for name in tiers}
        self.changed = asyncio.Event()   # set on every unpin and completed move: room may have appeared

    def commit(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int], *, cold: bool = False,
               skip: Container[BlockKey] = ()) -> None:
        """Make block ``keys[i]`` resident in ``slots[i]`` of ``name`` and admit it to the tier's policy
        (this runs for every block a load brings); ``skip``: keys whose slot is released instead
        (their source failed verification)."""
        pool = self.tiers[name].pool
        added, taken, spare = self.directory.commit(keys, name, slots, skip)
        pool.commit_many(taken)
        pool.release_many(spare)
        self.admit(name, added, cold=cold)
        self.stats[name].bytes_in += len(added) * self.block_bytes

    def admit(self, name: str, keys: Sequence[BlockKey], *, cold: bool = False) -> None:
        """Tell ``name``'s policy the blocks are resident (``cold``: on a prefetch's guess), and
        where they sit if the policy asks."""
        policy = self.policies[name]
        if cold and implements(policy, AdmitsCold):
            for key in keys:
                policy.insert_cold(key)
            self.directory.cold.update((key, name) for key in keys)
        elif implements(policy, InsertsMany):
            policy.insert_many(keys)
        else:
            for key in keys:
                policy.insert(key)
        if implements(policy, DescribesBlocks):
            get = self.directory.get
            for key in keys:
                if (entry := get(key)) is not None:
                    policy.describe(key, layer=entry.layer, index=entry.index)

    def remove_copy(self, key: BlockKey, name: str) -> None:
        """Free ``key``'s slot in ``name`` (its policy is told apart, where it has not chosen it)."""
        self.directory.cold.discard((key, name))
        entry = self.directory.entry(key)
        slot = entry.copies.pop(name)
        tier = self.tiers[name]
        if tier.medium is Medium.NVME:
            tier.drop(key, slot)
        tier.pool.release(slot)

    def remove_copies(self, keys: Sequence[BlockKey], name: str) -> None:
        """`remove_copy` of each of ``keys`` (chosen by ``name``'s policy), forgetting the entries left
        with no copy: the eviction of many blocks at once."""
        tier, cold = self.tiers[name], self.directory.cold
        if cold:
            cold.difference_update((key, name) for key in keys)
        slots = self.directory.remove_copies(keys, name)
        if tier.medium is Medium.NVME:
            for key, slot in zip(keys, slots):
                tier.drop(key, slot)
        tier.pool.release_many(slots)

    def forget_copy(self, key: BlockKey, name: str) -> None:
        """``remove_copy``, and ``name``'s policy forgets the block too."""
        self.remove_copy(key, name)
        self.policies[name].remove(key)

    def index_persisted(self, name: str) -> None:
        """A reopened store's blocks: resident there, held by nobody, known to its policy."""
        tier = self.tiers[name]
        if tier.medium is not Medium.NVME:
            return
        keys, slots = tier.keys_and_slots()
        self.directory.add_copies(keys, name, slots)
        self.admit(name, keys)
        self.stats[name].peak_slots = tier.pool.used

    def refresh_store(self, name: str) -> bool:
        """Take in the blocks other processes stored in (or dropped from) the shared store ``name``
        since the last look; whether anything changed. A block gone there is forgotten here unless a
        reader holds it (that read fails its checksum); one this process holds or writes itself
        keeps this process's copy. A second look takes in the blocks written into the slots the
        first one let go of."""
        tier, changed = self.tiers[name], False
        for _ in range(2):   # the second look only if the first let go of slots
            changes = tier.refresh()
            for key, slot in changes.removed:
                entry = self.directory.get(key)
                if entry is not None and entry.copies.get(name) == slot and not tier.pool.pins(slot):
                    self.forget_copy(key, name)
                    self.directory.forget_if_empty(key)
            for key, slot in changes.added:
                entry = self.directory.add(key, hold=False)
                held = entry.copies.get(name)
                if held == slot:
                    continue
                if held is not None and tier.pool.owns(slot):
                    tier.hold_back(key, slot)   # the copy held is one the store no longer shows (a reader
                    continue                    # holds it): this one, maybe its only, comes in once it goes
                if name in entry.copies or name in entry.arriving:
                    tier.forget(key, slot)
                    tier.pool.release(slot)
                    continue
                entry.copies[name] = slot
                self.admit(name, (key,))
            changed |= bool(changes)
            if not changes.removed:
                break
        return changed

    def pin(self, keys: Sequence[BlockKey], places: Sequence[Place],
            fresh: Container[BlockKey] = ()) -> tuple[Place, ...]:
        """Pin every key where ``Directory.find`` found it, and tell the policies of the use
        (``fresh``: blocks loaded for this read, just inserted: not a reuse)."""
        policies, cold = self.policies, self.directory.cold
        groups = by_tier(places)
        for name, (slots, _) in groups.items():
            self.tiers[name].pool.pin_many(slots)
        if not cold:      # the common read: the keys not loaded for it are reuses, one call per tier
            for name, (_, at) in groups.items():
                mine = keys if at is None else list(compress(keys, at))
                touch_all(policies[name], list(filterfalse(fresh.__contains__, mine)) if fresh else mine)
            return tuple(places)
        for key, (name, _) in zip(keys, places):
            if cold and (key, name) in cold:  # a guessed block's first use: no longer a guess
                cold.discard((key, name))
                policies[name].touch(key)
            elif key not in fresh:
                policies[name].touch(key)
        return tuple(places)

    def unpin(self, places: Iterable[Place]) -> None:
        for name, (slots, _) in by_tier(places).items():
            self.tiers[name].pool.unpin_many(slots)
        self.changed.set()


def touch_all(policy: EvictionPolicy, keys: Sequence[BlockKey]) -> None:
    """``policy.touch`` each key: in one call where the policy takes them so (``TouchesMany``)."""
    if implements(policy, TouchesMany):
        policy.touch_many(keys)
    else:
        for key in keys:
            policy.touch(key)


def by_tier(places: Iterable[Place]) -> dict[str, tuple[list[int], list[bool] | None]]:
    """Per tier: its slots, and which of ``places`` are its (None: all of them). A read's blocks sit in
    one tier or a few, so each is picked out in C-level passes, not a Python step per block."""
    places = list(places)
    if not places:
        return {}
    names = list(map(itemgetter(0), places))
    slots = list(map(itemgetter(1), places))
    first = names[0]
    if names.count(first) == len(names):
        return {first: (slots, None)}
    groups = {}
    for name in dict.fromkeys(names):
        mine = list(map(name.__eq__, names))
        groups[name] = (list(compress(slots, mine)), mine)
    return groups
