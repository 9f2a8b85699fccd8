"""Moves: every copy of blocks between tiers follows one two-phase protocol::

    prepare   reserve destination slots (making room may await demotions),
              then pin the source slots -- no await between the two
    transfer  the executor runs the handler on a worker thread
    complete  (on the loop) commit or release destination slots, unpin
              sources, update the directory and the eviction policies

Completion runs as a callback of the transfer itself, so a caller that is
cancelled mid-wait leaks nothing: the move still completes or rolls back.
Budgets are slot counts in each tier's pool; nothing is ever placed without
a reserved slot, so no tier can exceed its budget. A move is announced in the
directory (``claim``) before it is prepared, so a second reader joins it.

Making room asks the tier's eviction policy for victims (never the ones
`placement.evictable` refuses) and demotes or drops them as
`placement.split_victims` decides; a tier whose every slot is pinned waits up
to ``pin_wait_s`` for a reader to unpin.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import compress, repeat

import numpy as np
import torch

from tierkv.errors import BlockCorrupt, BudgetExceeded
from tierkv.keys import BlockKey
from tierkv.manager import placement
from tierkv.manager.executor import Executor
from tierkv.manager.residency import Residency
from tierkv.manager.transfer import Kind, Priority, Transfer, handler_for, put_handler_for
from tierkv.policy import EvictionPolicy
from tierkv.tiers.base import Medium, Tier


class Moves:
    def __init__(self, tiers: Mapping[str, Tier], order: Sequence[str], policies: Mapping[str, EvictionPolicy],
                 residency: Residency, executor: Executor) -> None:
        self.tiers, self.order, self.policies = tiers, order, policies
        self.residency, self.directory = residency, residency.directory
        self.executor = executor
        self.block_bytes = residency.block_bytes
        self.memory_tiers = placement.memory_tiers(order, tiers)
        self.pin_wait_s = 10.0            # how long a full tier waits for readers to unpin

    # -- new blocks and write-backs ---------------------------------------
    async def put_new(self, keys: list[BlockKey], rows: torch.Tensor, order: Sequence[str],
                      layer: int | None) -> None:
        """A caller's new blocks ``rows`` [n, block_bytes] into the tiers of ``order`` (placement.put_order):
        free slots fastest tier first, then room made in the fastest tier that can; as few transfers as
        the tiers' room allows. A block not placed when this raises is forgotten (those placed stay)."""
        first = 0
        try:
            while first < len(keys):
                for name, count in placement.put_attempts(order, self.tiers, len(keys) - first):
                    try:
                        slots = await self.reserve(name, count)
                    except BudgetExceeded:
                        if name != order[-1]:
                            continue
                        raise
                    end = first + count
                    await self.place(keys[first:end], name, slots, rows[first:end], layer)
                    first = end
                    break
                else:   # only a tier with free slots was tried, and it had none after all
                    raise BudgetExceeded(f"no tier of {', '.join(order)} could take a new block")
        except BaseException:
            for key in keys[first:]:
                self.directory.forget_if_empty(key)
            raise

    async def place(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int], rows: torch.Tensor,
                    layer: int | None) -> None:
        """Write a caller's new blocks ``rows`` [n, block_bytes] into ``slots`` (reserved) of ``name``:
        one transfer for them all."""
        tier = self.tiers[name]
        transfer = Transfer(Kind.PUT, "", name, tuple(keys), (), tuple(slots), len(keys) * self.block_bytes, layer)
        body = partial(put_handler_for(tier.medium), transfer, rows, tier)
        job = self.executor.submit(transfer, body, Priority.NOW)

        def forget(_: object = None) -> None:
            if job.done() and not job.cancelled():
                job.exception()          # retrieved: what it raised reached this call's caller, or nobody
            tier.pool.release_many(list(slots))
            for key in keys:
                self.directory.forget_if_empty(key)
        try:
            await asyncio.shield(job)
        except BaseException:
            if job.done():
                forget()
            else:        # cancelled while the write runs: its slots are freed once it is over, not under it
                job.add_done_callback(forget)
            raise
        self.residency.commit(transfer.keys, name, transfer.dst_slots)

    async def writeback(self, keys: Sequence[BlockKey], store: str, done: asyncio.Future) -> None:
        """Copy ``keys`` (claimed into ``store`` by ``done``) from the fastest memory tier holding each:
        one move per source tier. A key no memory tier holds any more was demoted (so it is stored)
        or dropped, and is settled with nothing to copy."""
        by_source: dict[str, list[BlockKey]] = {}
        for key in keys:
            entry = self.directory.get(key)
            source = None if entry is None else placement.load_source(entry, self.memory_tiers)
            if source is not None:
                by_source.setdefault(source, []).append(key)
        # each group is claimed by its own move; what still names ``done`` (nothing to copy) settles now
        moves = [self._move(group, source, store, Kind.WRITEBACK, Priority.WRITEBACK, None, self.claim(group, store))
                 for source, group in by_source.items()]
        self._settle(keys, store, done, None)
        errors = [r for r in await asyncio.gather(*moves, return_exceptions=True) if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    # -- moves ---------------------------------------------------------------
    async def bring(self, keys: Sequence[BlockKey], dst: str, layer: int | None,
                    priority: Priority, *, cold: bool = False) -> None:
        """Make every key resident in ``dst`` (joining moves already in flight; ``cold``: the
        moves this call starts insert their blocks cold)."""
        by_source, joins = self.directory.plan_loads(list(dict.fromkeys(keys)), dst, self.order)
        joined = [move for _, move in joins]
        if priority is Priority.NOW:
            for key, _ in joins:
                self.executor.boost_moves(key, dst, Priority.NOW)
        kind = Kind.LOAD if priority is Priority.NOW else Kind.PREFETCH
        moves = [self._move(group, src, dst, kind, priority, layer, self.claim(group, dst), cold=cold, shielded=True)
                 for src, group in by_source.items()]
        # shielded: a caller cancelled before its moves start leaves them to run, so every claim made
        # above settles (a move never started would leave later readers joined to it forever)
        if len(moves) == 1 and not joined:   # the usual load: one source, nothing to join (no gather)
            results = [await asyncio.shield(moves[0])]
        else:
            results = await asyncio.shield(asyncio.gather(*moves, *(asyncio.shield(f) for f in joined),
                                                          return_exceptions=True))
        corrupt = [k for r in results if isinstance(r, list) for k in r]
        errors = [r for r in results if isinstance(r, BaseException)]
        if corrupt:
            raise BlockCorrupt(f"{len(corrupt)} block(s) failed their checksum and were dropped: "
                               + ", ".join(k.hex()[:16] for k in corrupt[:4]), tuple(corrupt))
        if errors:
            raise errors[0]

    def claim(self, keys: Sequence[BlockKey], dst: str) -> asyncio.Future:
        """Announce a move of ``keys`` into ``dst`` (synchronously, so later readers join it)."""
        done = asyncio.get_running_loop().create_future()
        self.directory.arrive(keys, dst, done)
        return done

    async def check_stored(self, keys: Sequence[BlockKey]) -> None:
        """Read the NVMe store's copy of each of ``keys`` (pinned meanwhile) and drop those that fail."""
        store = next((t for t in self.tiers.values() if t.medium is Medium.NVME), None)
        entries = [(k, self.directory.get(k)) for k in keys]
        on_disk = [(k, e.copies[store.name]) for k, e in entries if store and e and store.name in e.copies]
        if not on_disk:
            return
        checked = [k for k, _ in on_disk]
        done = self.claim(checked, store.name)   # announced as a move: a drop of one of them waits for it
        try:
            for _, slot in on_disk:
                store.pool.pin(slot)
            buf = torch.empty(len(on_disk), self.block_bytes, dtype=torch.uint8)
            try:
                failed = await asyncio.to_thread(store.read, [(k, s, buf[i]) for i, (k, s) in enumerate(on_disk)])
            finally:
                for _, slot in on_disk:
                    store.pool.unpin(slot)
            read_at = dict(on_disk)
            for key in failed:
                entry = self.directory.get(key)
                if entry is not None and entry.copies.get(store.name) == read_at[key]:   # the copy read, still
                    self.residency.forget_copy(key, store.name)
                    self.directory.forget_if_empty(key)
        finally:
            self._settle(checked, store.name, done, None)

    async def _move(self, keys: list[BlockKey], src: str, dst: str, kind: Kind, priority: Priority,
                    layer: int | None, done: asyncio.Future, *, cold: bool = False,
                    shielded: bool = False) -> list[BlockKey]:
        """Copy ``keys`` (claimed by ``done``) from ``src`` to ``dst``; returns keys whose source was corrupt.
        ``shielded``: this runs as a task its caller shields, so nothing cancels it: it waits on ``done``
        itself, a turn of the loop sooner than through a shield of its own."""
        try:
            dst_slots = await self.reserve(dst, len(keys))
        except BaseException as error:
            self._settle(keys, dst, done, error)
            raise
        found = self.directory.slots_in(keys, src)
        if found.min() < 0:  # evicted from the source while we made room: the caller retries
            self.tiers[dst].pool.release_many(dst_slots)
            self._settle(keys, dst, done, None)
            return []
        src_slots = found.tolist()
        self.tiers[src].pool.pin_many(src_slots)
        wanted = self.directory.wanted.get    # .get: a Counter's [] calls Python code for every absent key
        if any(map(wanted, zip(keys, repeat(dst)))):
            priority = Priority.NOW  # a caller started waiting while this move was prepared
        transfer = Transfer(kind, src, dst, tuple(keys), tuple(src_slots), tuple(dst_slots),
                            len(keys) * self.block_bytes, layer, cold=cold)
        handler = handler_for(self.tiers[src].medium, self.tiers[dst].medium)
        body = partial(handler, transfer, self.tiers[src], self.tiers[dst])
        self.executor.submit(transfer, body, priority, partial(self._complete, transfer, done))
        return await (done if shielded else asyncio.shield(done))

    def _complete(self, t: Transfer, done: asyncio.Future, result: object, error: BaseException | None) -> None:
        self.tiers[t.src].pool.unpin_many(t.src_slots)
        failed = set() if error is not None else set(result)
        if error is not None:
            self.tiers[t.dst].pool.release_many(t.dst_slots)
        else:
            self.residency.commit(t.keys, t.dst, t.dst_slots, cold=t.cold, skip=failed)
        self.residency.stats[t.src].bytes_out += t.nbytes
        for key in failed:
            self.residency.forget_copy(key, t.src)
        if error is None and t.kind is Kind.DEMOTE:   # the source's copies go, but those a reader pinned meanwhile
            pinned = self.tiers[t.src].pool.pins_of(np.asarray(t.src_slots, np.int64)).astype(bool).tolist()
            kept = list(compress(t.keys, pinned))
            gone = [key for key, held in zip(t.keys, pinned) if not held and key not in failed]
            if kept:
                self.residency.admit(t.src, kept)
            if gone:
                self.residency.remove_copies(gone, t.src)   # their policy already forgot them
        self.residency.changed.set()
        self._settle(t.keys, t.dst, done, error, sorted(failed))

    def _settle(self, keys: Sequence[BlockKey], dst: str, done: asyncio.Future,
                error: BaseException | None, failed: list[BlockKey] | None = None) -> None:
        self.directory.settle(keys, dst, done)
        if done.done():
            return
        if error is None:
            done.set_result(failed or [])
        else:
            done.set_exception(error)
            done.exception()  # retrieved here: callers may have gone away

    # -- room ----------------------------------------------------------------
    async def reserve(self, name: str, n: int) -> list[int]:
        """``n`` slots of ``name``, evicting (and waiting for pins) as it must."""
        pool = self.tiers[name].pool
        if n > pool.capacity:
            raise BudgetExceeded(f"tier {name}: {n} blocks requested, the budget holds {pool.capacity}")
        while not pool.can_reserve(n):   # (a shared store counts free slots it may not claim: at least one)
            await self._make_room(name, max(1, n - pool.free))
        slots = pool.reserve_many(n)
        self.residency.stats[name].peak_slots = max(self.residency.stats[name].peak_slots, pool.used)
        return slots

    async def _make_room(self, name: str, need: int) -> None:
        guard = placement.Unevictable(name, self.directory, self.tiers, self.order)
        victims = self.policies[name].evict(need, guard) or []
        while len(victims) < need and (chosen := self.policies[name].evict(1, guard)):
            victims.extend(chosen)  # fewer than ``need`` can go: take what can
        if not victims:
            if await self._room_may_appear(name):
                return
            raise BudgetExceeded(f"tier {name}: all {self.tiers[name].pool.capacity} slots are pinned or "
                                 "hold the only copy of protected blocks; raise its budget or add a lower tier")
        room = placement.room_below(name, self.order, self.tiers)
        demote, drop = placement.split_victims(victims, name, self.directory, self.order, room)
        self.residency.remove_copies(drop, name)
        if demote:
            await self._demote(demote, name)

    async def _room_may_appear(self, name: str) -> bool:
        """Wait while moves run or slots of ``name`` are pinned or reserved; False when nothing can change."""
        pool = self.tiers[name].pool
        if not (pool.busy_slots() or self.executor.busy):
            return False
        changed = self.residency.changed
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), timeout=self.pin_wait_s)
        except TimeoutError:
            return False
        return True

    async def _demote(self, keys: list[BlockKey], name: str) -> None:
        """Move ``keys`` down from ``name``: to the tier below, or, for more than it can hold at all (a
        small tier under a load's only copies), those beyond its capacity to the tier under it."""
        try:
            below = placement.tier_below(self.order, name)
            further = placement.tier_below(self.order, below)
            fits = self.tiers[below].pool.capacity if further is not None else len(keys)
            for part, dst in ((keys[:fits], below), (keys[fits:], further)):
                if part:
                    await self._move(part, name, dst, Kind.DEMOTE, Priority.NOW, None, self.claim(part, dst))
        except BaseException:
            for key in keys:  # still resident here: give them back to the policy
                if name in self.directory.entry(key).copies:
                    self.residency.admit(name, (key,))
            raise
