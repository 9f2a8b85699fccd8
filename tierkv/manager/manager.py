"""The tier manager: placement, promotion, demotion, write-back and prefetch, orchestrated on asyncio.

Tiers are ordered fastest first. ``acquire`` brings blocks into a tier and
pins them for the caller; ``read`` pins those in place at once and starts
loading the rest (the blocking facade's ``ReadFuture``); ``prefetch`` loads
in the background at a lower priority; ``put`` places new blocks; ``flush`` waits for write-backs.
The pieces it orchestrates::

    TierManager  the calls above, the lifecycle, hit events, the access hook    (this module)
      Directory  which block is where, who waits to pin it, guesses not read    directory.py
      Rows       a block's bookkeeping in arrays; BlockEntry, a view of a row   rows.py
      ArrayLRU   the NVMe store's LRU order, a stamp per directory row          array_lru.py
      placement  pure decisions: put order, sources, evictable, demote/drop     placement.py
      Moves      the two-phase protocol prepare -> transfer -> complete         moves.py
      Residency  slots committed / released / pinned, policies and stats told   residency.py
      Executor   transfers in priority order on a runner (worker threads)       executor.py
      remote     write-through to a shared store, read on a miss (optional)     remote.py
      build      the tiers and policies a TierConfig names, checks of tiers     build.py
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import cached_property, partial
from itertools import compress, repeat
from operator import is_not, itemgetter, not_

import numpy as np
import torch

from tierkv.config import TierConfig
from tierkv.knobs import IOKnobs
from tierkv.errors import BudgetExceeded, ManagerClosed
from tierkv.keys import BlockKey
from tierkv.manager import placement
from tierkv.manager.build import build_policies, build_tiers, check_tiers, named_policies
from tierkv.manager.directory import Directory, Place
from tierkv.manager.executor import Executor
from tierkv.manager.lease import Lease
from tierkv.manager.moves import Moves
from tierkv.manager.remote import Recompute, WriteThrough
from tierkv.manager.residency import Residency
from tierkv.manager.transfer import Priority
from tierkv.policy import EvictionPolicy, ObservesScores, implements
from tierkv.events import AccessHook, Event, EventKind, EventRecorder
from tierkv.tiers.base import Medium, Tier
from tierkv.tiers.remote import RemoteStore

_MAX_ATTEMPTS = 16  # re-loads of a block evicted before its reader could pin it


class TierManager:
    def __init__(self, tiers: Sequence[Tier], *, policies: dict[str, EvictionPolicy] | None = None,
                 knobs: IOKnobs | None = None, recorder: EventRecorder | None = None,
                 executor: Executor | None = None, remote: RemoteStore | None = None) -> None:
        """``executor`` replaces the default one on worker threads (the replay passes one whose runner
        completes transfers in modelled time); ``remote`` is a store below the tiers shared with other
        processes and machines (see tierkv.manager.remote)."""
        self.block_bytes = check_tiers(tiers)
        self.tiers = {t.name: t for t in tiers}
        self.order = [t.name for t in tiers]
        self.directory = Directory()
        self.policies = build_policies(tiers, self.directory, policies)
        self.knobs = knobs or IOKnobs.from_env()
        self.events = recorder or EventRecorder()
        for tier in tiers:  # a pool's link model records its queue and link slices with ours
            if getattr(tier, "link", None) is not None and tier.link.recorder is None:
                tier.link.recorder = self.events
        self._residency = Residency(self.tiers, self.policies, self.directory, self.block_bytes)
        self.stats = self._residency.stats
        self._executor = executor or Executor(self.knobs.copy_threads, self.knobs.inflight_bytes, self.events)
        self._moves = Moves(self.tiers, self.order, self.policies, self._residency, self._executor)
        self.access: AccessHook | None = None   # records which blocks each step used (replay traces)
        self.remote = remote
        self.recompute: Recompute | None = None      # what recomputing a block costs (set by its engine)
        self._write_through: WriteThrough | None = None
        self._background: set[asyncio.Task] = set()
        self._writeback_errors: list[BaseException] = []
        self._state = "new"

    @classmethod
    def from_config(cls, config: TierConfig, *, namespace: str = "default",
                    knobs: IOKnobs | None = None, recorder: EventRecorder | None = None) -> TierManager:
        knobs = knobs or IOKnobs.from_env()
        tiers = build_tiers(config, namespace=namespace, knobs=knobs)
        remote = None if config.remote is None else RemoteStore(config.remote, namespace, ttl_s=config.remote_ttl)
        return cls(tiers, policies=named_policies(config, tiers), knobs=knobs, recorder=recorder, remote=remote)

    # -- lifecycle ------------------------------------------------------
    async def start(self) -> TierManager:
        if self._state != "new":
            raise ManagerClosed(f"tier manager cannot start: it is {self._state}")
        self._executor.start()
        for name in self.order:
            self._residency.index_persisted(name)
        if self.remote is not None:
            await asyncio.to_thread(self.remote.probe)
            self._write_through = WriteThrough(self.remote)
        self._state = "running"
        return self

    async def aclose(self) -> None:
        """Finish write-backs, abort queued moves, close every tier. Idempotent."""
        if self._state == "closed":
            return
        if self._state == "running":
            await asyncio.gather(*self._background, return_exceptions=True)
        self._state = "closed"
        await self._executor.aclose()
        for tier in self.tiers.values():
            await asyncio.to_thread(tier.close)
        if self._write_through is not None:
            await asyncio.to_thread(self._write_through.close)
        if self.remote is not None:
            self.remote.close()

    async def __aenter__(self) -> TierManager:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- queries --------------------------------------------------------
    @property
    def pin_wait_s(self) -> float:
        """How long a full tier waits for readers to unpin before a move fails (seconds)."""
        return self._moves.pin_wait_s

    @pin_wait_s.setter
    def pin_wait_s(self, seconds: float) -> None:
        self._moves.pin_wait_s = seconds

    @cached_property
    def memory_tiers(self) -> list[str]:
        return placement.memory_tiers(self.order, self.tiers)

    @cached_property
    def in_place_tiers(self) -> list[str]:
        """Memory tiers a reader may use in place (``tier=None``); see `placement.in_place_tiers`."""
        return placement.in_place_tiers(self.order, self.tiers)

    @property
    def store(self) -> Tier | None:
        return next((t for t in self.tiers.values() if t.medium is Medium.NVME), None)

    def contains(self, key: BlockKey) -> bool:
        entry = self.directory.get(key)
        if (entry is None or not entry.copies) and self.refresh():
            entry = self.directory.get(key)
        return entry is not None and bool(entry.copies)

    def refresh(self) -> bool:
        """Take in blocks other processes stored in (or dropped from) a shared NVMe store; whether
        anything changed. Called on a lookup that misses; cheap when nothing did."""
        store = self.store
        return store is not None and self._state == "running" and self._residency.refresh_store(store.name)

    def where(self, key: BlockKey) -> list[str]:
        return self.directory.tiers_of(key, self.order)

    def used_bytes(self, tier: str) -> int:
        return self.tiers[tier].pool.used * self.block_bytes

    @property
    def wants_scores(self) -> bool:
        """Some tier's policy ranks blocks by the attention they receive (``observe``)."""
        return any(implements(p, ObservesScores) for p in self.policies.values())

    def observe(self, scores: Iterable[tuple[BlockKey, float]]) -> None:
        """Attention mass per block in one step, for the policies that rank by it."""
        observers = [p for p in self.policies.values() if implements(p, ObservesScores)]
        for key, score in scores:
            for policy in observers:
                policy.observe(key, score)

    # -- placing new blocks ---------------------------------------------
    async def put(self, key: BlockKey, data: torch.Tensor, *, tier: str | None = None,
                  layer: int | None = None, index: int | None = None, protect: bool = True,
                  persist: bool = False, share: bool = True) -> None:
        """Store a new block (exactly ``block_bytes``): `put_many` of one, ``index`` its position in its layer."""
        await self.put_many([key], data, tier=tier, layer=layer, first_index=index, protect=protect,
                            persist=persist, share=share)

    async def put_many(self, keys: Sequence[BlockKey], rows: torch.Tensor, *, tier: str | None = None,
                       layer: int | None = None, first_index: int | None = None, protect: bool = True,
                       persist: bool = False, share: bool = True) -> None:
        """Store new blocks in ``tier`` (default: the fastest with room), together: a reservation (an
        eviction) and a copy per tier, one write-back. ``rows`` holds them in order, ``block_bytes``
        each (``[len(keys), block_bytes]``, or any tensor of those bytes). A key names its content:
        putting a key that is already stored only adds a holder (``protect``: the caller holds the block
        until it ``drop``s or ``unprotect``s it). ``persist`` also writes them back to the NVMe store and,
        with ``share``, through to the remote store. ``layer`` and ``first_index + i`` (block i's position
        in its layer) are hints for policies that rank by position (see tierkv.policy). A call that
        raises holds none of them (what it placed stays as cache nobody holds)."""
        self._check_running()
        if not keys:
            return
        order = placement.put_order(tier, self.order)
        rows = _as_rows(rows, len(keys), self.block_bytes)
        if self.access is not None:
            for key in keys:
                self.access.on_put(key, layer)
        stored = self.directory.add_many(keys, hold=protect, layer=layer, first_index=first_index)
        new: dict[BlockKey, int] = {}       # a key already stored (or twice in keys) only gains a holder
        for i in np.flatnonzero(~stored).tolist():
            new.setdefault(keys[i], i)
        if not new:
            return
        placed = rows if len(new) == len(keys) else rows[list(new.values())]
        try:
            await self._moves.put_new(list(new), placed, order, layer)
        except BaseException:
            if protect:
                self.unprotect(keys)
            raise
        if persist:
            self.persist(new)
            if share and self._write_through is not None:
                for key, raw in zip(new, placed):
                    self._write_through.offer(key, raw.cpu().numpy().tobytes())

    def persist(self, keys: Iterable[BlockKey]) -> None:
        """Write blocks back to the NVMe store in the background (one move per source tier); ``flush``
        waits."""
        store = self.store
        if store is None:
            return
        entries = ((key, self.directory.entry(key)) for key in dict.fromkeys(keys))
        todo = [key for key, e in entries if store.name not in e.copies and store.name not in e.arriving]
        if todo:
            self._spawn(self._moves.writeback(todo, store.name, self._moves.claim(todo, store.name)))

    async def flush(self) -> None:
        """Wait for pending write-backs and make the store durable; raise their first error."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.flush)
        if self._write_through is not None:
            await asyncio.to_thread(self._write_through.drain)
        if self._writeback_errors:
            errors, self._writeback_errors = self._writeback_errors, []
            raise errors[0]

    def protect(self, keys: Iterable[BlockKey]) -> bool:
        """The caller holds these stored blocks too (a reused prefix, a fork); False, holding none,
        if any is gone."""
        keys = list(keys)
        missing = self.hold(keys)
        if missing:
            gone = set(missing)
            self.unprotect([key for key in keys if key not in gone])
        return not missing

    def hold(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Hold those of ``keys`` that are stored (as ``protect``); returns the rest, which a caller
        can compute again (a repair) before it reads them."""
        keys = keys if isinstance(keys, Sequence) else list(keys)
        rows, stored = self.directory.stored(keys)
        if not stored.all() and self.refresh():
            rows, stored = self.directory.stored(keys)
        self.directory.hold_rows(rows[stored])
        return self._unstored(keys, stored)

    async def scrub(self, keys: Sequence[BlockKey], *, batch: int = 64) -> list[BlockKey]:
        """Read the NVMe store's copy of each of ``keys`` and check it, dropping the copies that fail
        their checksum; returns the keys stored nowhere now (never stored, lost, or only in a copy
        that failed). A block held only in memory tiers counts as sound."""
        self.refresh()
        for first in range(0, len(keys), batch):
            await self._moves.check_stored(keys[first:first + batch])
        return self._unstored(keys)

    def _unstored(self, keys: Sequence[BlockKey], stored: np.ndarray | None = None) -> list[BlockKey]:
        """Those of ``keys`` with no copy anywhere and none on its way (``stored``: already looked up)."""
        stored = self.directory.stored(keys)[1] if stored is None else stored
        return [keys[i] for i in np.flatnonzero(~stored).tolist()]

    def unprotect(self, keys: Iterable[BlockKey]) -> None:
        """The caller lets go of these blocks; one that nobody holds any more becomes evictable cache."""
        self.directory.let_go(keys if isinstance(keys, Sequence) else list(keys))

    async def drop(self, keys: Iterable[BlockKey]) -> None:
        """The caller lets go of these blocks; one that nobody else holds is removed from every tier
        (the NVMe store included)."""
        for key in keys:
            entry = self.directory.get(key)
            if entry is None:
                continue
            if entry.holders:
                entry.holders -= 1
            if entry.holders:
                continue           # another sequence still holds it
            if entry.arriving:
                await asyncio.gather(*entry.arriving.values(), return_exceptions=True)
            for name in list(entry.copies):
                self._residency.forget_copy(key, name)
            self.directory.forget_if_empty(key)

    # -- reading --------------------------------------------------------
    async def acquire(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                      layer: int | None = None, priority: Priority = Priority.NOW, thread: int | None = None) -> Lease:
        """Pin ``keys`` in ``tier`` (None: any memory tier, loading into the fastest) for ``thread`` (an ident,
        whose stall the wait is; None: the loop's). Raises BlockMissing for a block stored nowhere and
        BlockCorrupt for one whose stored bytes failed their checksum (it is dropped: recompute it)."""
        return await self._acquire(keys, tier, layer=layer, priority=priority, rest_of=False, thread=thread)

    async def _acquire(self, keys: Sequence[BlockKey], tier: str | None, *, layer: int | None, priority: Priority,
                       rest_of: bool, rows: np.ndarray | None = None, thread: int | None = None) -> Lease:
        """``acquire``; ``rest_of``: ``load_missing``'s (``rows``: its guesses), whose caller records its own stall."""
        self._check_read(tier)
        if self.access is not None and not rest_of:
            self.access.on_acquire(keys, layer)
        start = time.perf_counter()
        target = tier or self.memory_tiers[0]
        if rest_of:   # `read` found none of them in place an instant ago, and recorded its hits
            found: list[Place | None] = [None] * len(keys)
            not_in_place = len(keys)
        else:
            found = self.directory.find(keys, self._readable(tier))
            not_in_place = self._record_hits(found, layer)
        if not not_in_place:   # all in place: pinned with no await, nothing can evict them meanwhile
            return Lease(tuple(keys), self._residency.pin(keys, found), self.tiers, self._unpin)
        if not self.directory.knows_all(keys, rows):
            self.refresh()   # another process may have stored them
        wanted = list(zip(keys, repeat(target)))
        self.directory.want(wanted)  # blocks in (or arriving into) the target stay there until pinned
        loaded: set[BlockKey] = set()
        missing = list(keys) if rest_of else [k for k, place in zip(keys, found) if place is None]
        readable = self._readable(tier)
        try:
            for attempt in range(_MAX_ATTEMPTS):
                if attempt:
                    missing = [k for k in keys if not self.directory.holds(k, readable)]
                loaded.update(missing)
                await self._moves.bring(missing, target, layer, priority)
                places = self._pin_resident(keys, tier, loaded)
                if places is not None:
                    if not rest_of:
                        self.events.wait("", target, layer, not_in_place * self.block_bytes, start, not_in_place,
                                         thread=thread)
                    return Lease(tuple(keys), places, self.tiers, self._unpin)
        finally:
            self.directory.unwant(wanted)
        raise BudgetExceeded(f"tier {tier}: blocks were evicted {_MAX_ATTEMPTS} times before they could "
                             f"be pinned; the tier is too small for {len(keys)} blocks at once")

    async def read(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                   layer: int | None = None) -> tuple[list[int], Lease, asyncio.Future | None]:
        """One read of ``keys``, split where it stands: ``(ready, lease, rest)``. ``ready``: the positions
        in ``keys`` of the blocks in place now, pinned under ``lease`` (no await: nothing evicts them
        meanwhile); ``rest``: a task acquiring the others (None: none), whose wait the caller records
        as its own stall (it computes on the ready blocks meanwhile)::

            keys    a b c d e          in place: b, d
            ready   [1, 3]             lease.keys (b, d)      rest -> Lease over (a, c, e)
        """
        self._check_read(tier)
        if self.access is not None:
            self.access.on_acquire(keys, layer)
        found = self.directory.find(keys, self._readable(tier))
        missing = None
        if self._record_hits(found, layer):
            here = list(map(is_not, found, repeat(None)))
            ready, ready_keys, places = list(compress(range(len(keys)), here)), list(compress(keys, here)), \
                list(compress(found, here))
            missing = list(compress(keys, map(not_, here)))
        else:                   # every block in place: the usual read at a step's reuse
            ready, ready_keys, places = list(range(len(keys))), keys, found
        lease = Lease(tuple(ready_keys), self._residency.pin(ready_keys, places), self.tiers, self._unpin)
        rest = None if missing is None else asyncio.ensure_future(self.load_missing(missing, tier, layer=layer))
        return ready, lease, rest

    async def load_missing(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                           layer: int | None = None, rows: np.ndarray | None = None) -> Lease:
        """``acquire`` of blocks a reader found in no tier read in place an instant ago (and recorded its hits
        and access for; ``rows``: their rows as it found them, checked as guesses): it computes meanwhile."""
        return await self._acquire(keys, tier, layer=layer, priority=Priority.NOW, rest_of=True, rows=rows)

    def _check_read(self, tier: str | None) -> None:
        self._check_running()
        if tier is not None and tier not in self.memory_tiers:
            raise ValueError(f"tier={tier!r}: blocks are read into a memory tier: {', '.join(self.memory_tiers)}")

    def _readable(self, tier: str | None) -> list[str]:
        """The tiers a read of ``tier`` finds blocks in (None: any tier read in place)."""
        return [tier] if tier is not None else self.in_place_tiers

    def _record_hits(self, found: Sequence[Place | None], layer: int | None) -> int:
        """Record a ``hit`` event per tier for the blocks found in place; returns how many are not."""
        hits = Counter(map(itemgetter(0), filter(None, found)))
        for name, n in hits.items():
            self.record_hits(name, n, layer)
        return len(found) - hits.total()

    def record_hits(self, name: str, blocks: int, layer: int | None) -> None:
        """A ``hit`` event: ``blocks`` read where they were, in tier ``name``."""
        if self.events.enabled:
            now = time.perf_counter()
            nbytes = blocks * self.block_bytes
            self.events.record(Event(EventKind.HIT, name, name, layer, nbytes, now, now, now, blocks))

    def prefetch(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                 layer: int | None = None, guess: bool = False) -> None:
        """Start loading ``keys`` into ``tier`` in the background; errors are recorded, not raised.

        ``guess``: the caller may not read them (a speculative selection); they enter the tier
        cold where its policy can (``AdmitsCold``), so an unused one is evicted first.
        """
        self._check_running()
        readable = self._readable(tier)
        missing = [k for k in keys if not self.directory.holds(k, readable)]
        if missing:
            self._spawn(self._moves.bring(missing, tier or self.memory_tiers[0], layer, Priority.PREFETCH, cold=guess),
                        quiet=True)

    def _pin_resident(self, keys: Sequence[BlockKey], tier: str | None,
                      fresh: set[BlockKey]) -> tuple[Place, ...] | None:
        found = self.directory.find(keys, self._readable(tier))
        return None if None in found else self._residency.pin(keys, found, fresh)

    def _unpin(self, places: Iterable[Place]) -> None:
        self._residency.unpin(places)

    def _spawn(self, coro, quiet: bool = False) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(partial(self._background_done, quiet=quiet))

    def _background_done(self, task: asyncio.Task, quiet: bool) -> None:
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if not quiet and not isinstance(task.exception(), ManagerClosed):
            self._writeback_errors.append(task.exception())

    def _check_running(self) -> None:
        if self._state != "running":
            raise ManagerClosed(f"tier manager is {self._state}; use `async with` or await start()")


def _as_rows(data: torch.Tensor, n: int, block_bytes: int) -> torch.Tensor:
    """``data``'s bytes as ``n`` rows of ``block_bytes`` (a view where it is contiguous)."""
    raw = data.contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() != n * block_bytes:
        raise ValueError(f"{raw.numel()} bytes for {n} block(s); this manager stores blocks of exactly {block_bytes}")
    return raw.view(n, block_bytes)
