"""The tier manager: placement, promotion, demotion, write-back and prefetch.

Every move follows one two-phase protocol::

    prepare   reserve destination slots (making room may await demotions),
              then pin the source slots -- no await between the two
    transfer  the executor runs the handler on a worker thread
    complete  (on the loop) commit or release destination slots, unpin
              sources, update the directory and the eviction policies

Completion runs as a callback of the transfer itself, so a caller that is
cancelled mid-wait leaks nothing: the move still completes or rolls back.
Budgets are slot counts in each tier's pool; nothing is ever placed without
a reserved slot, so no tier can exceed its budget.

Tiers are ordered fastest first. ``acquire`` brings blocks into a tier and
pins them for the caller; ``prefetch`` does the same in the background at a
lower priority; ``put`` places new blocks; ``flush`` waits for write-backs.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Protocol

import torch

from policies import make_policy
from tierkv.config import TierConfig
from tierkv.knobs import IOKnobs
from tierkv.errors import BlockCorrupt, BlockMissing, BudgetExceeded, ManagerClosed
from tierkv.keys import BlockKey
from tierkv.manager.directory import Directory
from tierkv.manager.executor import Executor
from tierkv.manager.transfer import Kind, Priority, Transfer, handler_for, put_handler_for
from tierkv.policy import AdmitsCold, DescribesBlocks, EvictionPolicy, ObservesScores, implements
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.tiers.base import Medium, Tier
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier

_MAX_ATTEMPTS = 16  # re-loads of a block evicted before its reader could pin it


@dataclass(slots=True)
class TierStats:
    peak_slots: int = 0
    bytes_in: int = 0     # written into the tier
    bytes_out: int = 0    # read out of the tier


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


class AccessHook(Protocol):
    """Told of every block a caller stores or reads (see tierkv.profile.access)."""

    def on_put(self, key: BlockKey, layer: int | None) -> None: ...

    def on_acquire(self, keys: Sequence[BlockKey], layer: int | None) -> None: ...


class _Unevictable(Container[Hashable]):
    """The keys a tier's policy must not choose, checked lazily per candidate."""

    def __init__(self, manager: TierManager, tier: str) -> None:
        self._manager, self._tier = manager, tier

    def __contains__(self, key: object) -> bool:
        return not self._manager._evictable(key, self._tier)  # type: ignore[arg-type]


def build_tiers(config: TierConfig, *, namespace: str = "default",
                knobs: IOKnobs | None = None) -> list[Tier]:
    knobs = knobs or IOKnobs.from_env()
    tiers: list[Tier] = []
    if config.gpu:
        tiers.append(GpuTier(config.block_bytes, config.gpu))
    if config.cpu:
        tiers.append(CpuTier(config.block_bytes, config.cpu))
    if config.cxl:
        from tierkv.tiers.cxl import CxlTier
        tiers.append(CxlTier(config.block_bytes, config.cxl, config.cxl_link()))
    if config.nvme_dir is not None:
        from tierkv.tiers.nvme import NvmeTier
        tiers.append(NvmeTier(config.nvme_dir, config.block_bytes, config.nvme_budget,
                              namespace=namespace, backend=knobs.nvme_backend,
                              io_threads=knobs.io_threads))
    return tiers


class TierManager:
    def __init__(self, tiers: Sequence[Tier], *, policies: dict[str, EvictionPolicy] | None = None,
                 knobs: IOKnobs | None = None, recorder: EventRecorder | None = None,
                 executor: Executor | None = None) -> None:
        """``executor`` replaces the thread-pool executor (the replay simulator passes a simulated one)."""
        if not tiers:
            raise ValueError("a tier manager needs at least one tier")
        sizes = {t.block_bytes for t in tiers}
        if len(sizes) != 1:
            raise ValueError(f"all tiers must share one block size, got {sorted(sizes)}")
        self.block_bytes = sizes.pop()
        if all(t.medium is Medium.NVME for t in tiers):
            raise ValueError("a tier manager needs a memory tier (gpu or cpu) to read blocks into")
        self.tiers = {t.name: t for t in tiers}
        self.order = [t.name for t in tiers]
        self.policies = {t.name: make_policy("lru", capacity=t.pool.capacity) for t in tiers} | (policies or {})
        self.knobs = knobs or IOKnobs.from_env()
        self.events = recorder or EventRecorder()
        for tier in tiers:  # a pool's link model records its queue and link slices with ours
            if getattr(tier, "link", None) is not None and tier.link.recorder is None:
                tier.link.recorder = self.events
        self.directory = Directory()
        self.stats = {name: TierStats() for name in self.order}
        self._executor = executor or Executor(self.knobs.copy_threads, self.knobs.inflight_bytes, self.events)
        self.access: AccessHook | None = None   # records which blocks each step used (replay traces)
        self._background: set[asyncio.Task] = set()
        self._writeback_errors: list[BaseException] = []
        self._state = "new"
        self._wanted: Counter[tuple[BlockKey, str]] = Counter()  # blocks callers wait to pin
        self._cold: set[tuple[BlockKey, str]] = set()   # (block, tier): a guess inserted cold, not read yet
        self._changed = asyncio.Event()   # set on every unpin and completed move
        self.pin_wait_s = 10.0            # how long a full tier waits for readers to unpin

    @classmethod
    def from_config(cls, config: TierConfig, *, namespace: str = "default",
                    knobs: IOKnobs | None = None, recorder: EventRecorder | None = None) -> TierManager:
        knobs = knobs or IOKnobs.from_env()
        tiers = build_tiers(config, namespace=namespace, knobs=knobs)
        policies = {"gpu": config.gpu_policy, "cpu": config.cpu_policy, "cxl": config.cxl_policy,
                    "nvme": config.nvme_policy}
        chosen = {t.name: make_policy(policies[t.name], capacity=t.pool.capacity) for t in tiers}
        return cls(tiers, policies=chosen, knobs=knobs, recorder=recorder)

    # -- lifecycle ------------------------------------------------------
    async def start(self) -> TierManager:
        if self._state != "new":
            raise ManagerClosed(f"tier manager cannot start: it is {self._state}")
        self._executor.start()
        for name in self.order:
            self._index_persisted(name)
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

    async def __aenter__(self) -> TierManager:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- queries --------------------------------------------------------
    @cached_property
    def memory_tiers(self) -> list[str]:
        return [n for n in self.order if self.tiers[n].medium is not Medium.NVME]

    @cached_property
    def in_place_tiers(self) -> list[str]:
        """Memory tiers a reader may use in place (``tier=None``). A pool behind a modelled link is
        not one (reading its views would bypass the model) unless no other memory tier exists."""
        direct = [n for n in self.memory_tiers if getattr(self.tiers[n], "reads_in_place", True)]
        return direct or self.memory_tiers

    @property
    def store(self) -> Tier | None:
        return next((t for t in self.tiers.values() if t.medium is Medium.NVME), None)

    def contains(self, key: BlockKey) -> bool:
        entry = self.directory.get(key)
        return entry is not None and bool(entry.copies)

    def where(self, key: BlockKey) -> list[str]:
        entry = self.directory.get(key)
        return [] if entry is None else [n for n in self.order if n in entry.copies]

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
                  persist: bool = False) -> None:
        """Store a new block (exactly ``block_bytes``) in ``tier`` (default: the fastest with room).

        A key names its content: putting a key that is already stored only
        marks it protected. ``persist`` also writes it back to the NVMe store.
        ``layer`` and ``index`` (the block's position in its layer) are hints
        for policies that rank by position (see tierkv.policy).
        """
        self._check_running()
        raw = _as_bytes(data, self.block_bytes)
        if self.access is not None:
            self.access.on_put(key, layer)
        entry = self.directory.add(key, protected=protect, layer=layer, index=index)
        if entry.copies or entry.arriving:
            return
        order = self._placement(tier)
        free = [n for n in order if self.tiers[n].pool.can_reserve()][:1]
        for name in free or order:  # a free slot anywhere beats evicting from the fastest tier
            try:
                slot = (await self._reserve(name, 1))[0]
            except BudgetExceeded:
                if name == order[-1]:
                    self.directory.forget_if_empty(key)
                    raise
                continue
            await self._place(entry.key, name, slot, raw, layer)
            break
        if persist:
            self.persist([key])

    def persist(self, keys: Iterable[BlockKey]) -> None:
        """Write blocks back to the NVMe store in the background; ``flush`` waits."""
        store = self.store
        if store is None:
            return
        for key in keys:
            entry = self.directory.entry(key)
            if store.name not in entry.copies and store.name not in entry.arriving:
                self._spawn(self._writeback(key, self._claim([key], store.name)))

    async def flush(self) -> None:
        """Wait for pending write-backs and make the store durable; raise their first error."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.flush)
        if self._writeback_errors:
            errors, self._writeback_errors = self._writeback_errors, []
            raise errors[0]

    def protect(self, keys: Iterable[BlockKey]) -> bool:
        """Keep these stored blocks (a reused prefix) for the caller; False if any is gone."""
        entries = [self.directory.get(k) for k in keys]
        if any(e is None or not (e.copies or e.arriving) for e in entries):
            return False
        for entry in entries:
            entry.protected = True
        return True

    def unprotect(self, keys: Iterable[BlockKey]) -> None:
        """The caller no longer needs these blocks kept: they become evictable cache."""
        for key in keys:
            entry = self.directory.get(key)
            if entry is not None:
                entry.protected = False

    async def drop(self, keys: Iterable[BlockKey]) -> None:
        """Remove blocks from every tier (the NVMe store included)."""
        for key in keys:
            entry = self.directory.get(key)
            if entry is None:
                continue
            if entry.arriving:
                await asyncio.gather(*entry.arriving.values(), return_exceptions=True)
            for name in list(entry.copies):
                self._remove_copy(key, name)
                self.policies[name].remove(key)
            self.directory.forget_if_empty(key)

    # -- reading --------------------------------------------------------
    async def acquire(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                      layer: int | None = None, priority: Priority = Priority.NOW,
                      rest_of: bool = False) -> Lease:
        """Pin ``keys`` in ``tier`` (None: any memory tier, loading into the fastest).

        ``rest_of``: these are the blocks a ``pin_ready`` of the same read left; the caller
        computes meanwhile, so it records its own stall (and the read was told to ``access``).

        Raises BlockMissing for a block stored nowhere and BlockCorrupt for
        one whose stored bytes failed their checksum (it is dropped: recompute it).
        """
        self._check_read(tier)
        if self.access is not None and not rest_of:
            self.access.on_acquire(keys, layer)
        start = time.perf_counter()
        target = tier or self.memory_tiers[0]
        found = self._find(keys, tier)
        not_in_place = self._record_hits(found, layer)
        if not not_in_place:   # all in place: pinned with no await, nothing can evict them meanwhile
            return Lease(tuple(keys), self._pin(keys, found), self.tiers, self._unpin)
        wanted = [(k, target) for k in keys]
        self._wanted.update(wanted)  # blocks in (or arriving into) the target stay there until pinned
        loaded: set[BlockKey] = set()
        missing = [k for k, place in zip(keys, found) if place is None]
        try:
            for attempt in range(_MAX_ATTEMPTS):
                if attempt:
                    missing = [k for k in keys if not self._resident(k, tier)]
                loaded.update(missing)
                await self._bring(missing, target, layer, priority)
                places = self._pin_resident(keys, tier, loaded)
                if places is not None:
                    if not rest_of:
                        self.events.wait("", target, layer, not_in_place * self.block_bytes, start, not_in_place)
                    return Lease(tuple(keys), places, self.tiers, self._unpin)
        finally:
            for item in wanted:
                if (left := self._wanted[item] - 1) > 0:
                    self._wanted[item] = left
                else:
                    del self._wanted[item]
        raise BudgetExceeded(f"tier {tier}: blocks were evicted {_MAX_ATTEMPTS} times before they could "
                             f"be pinned; the tier is too small for {len(keys)} blocks at once")

    def pin_ready(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                  layer: int | None = None) -> tuple[list[int], Lease]:
        """Pin those of ``keys`` that ``acquire`` would find in place now (no await: nothing can
        evict them meanwhile). Returns their positions in ``keys`` and a lease over them; the
        caller acquires the rest with ``rest_of=True`` while it works on these::

            keys    a b c d e          in place: b, d
            ready   [1, 3]             lease.keys (b, d)      acquire([a, c, e], rest_of=True)
        """
        self._check_read(tier)
        if self.access is not None:
            self.access.on_acquire(keys, layer)
        found = self._find(keys, tier)
        self._record_hits(found, layer)
        ready = [i for i, place in enumerate(found) if place is not None]
        ready_keys = [keys[i] for i in ready]
        places = self._pin(ready_keys, [found[i] for i in ready])
        return ready, Lease(tuple(ready_keys), places, self.tiers, self._unpin)

    def _check_read(self, tier: str | None) -> None:
        self._check_running()
        if tier is not None and tier not in self.memory_tiers:
            raise ValueError(f"tier={tier!r}: blocks are read into a memory tier: {', '.join(self.memory_tiers)}")

    def _record_hits(self, found: Sequence[tuple[str, int] | None], layer: int | None) -> int:
        """Record a ``hit`` event per tier for the blocks ``_find`` found in place; returns how many are not."""
        hits = Counter(name for name, _ in filter(None, found))
        if self.events.enabled:
            now = time.perf_counter()
            for name, n in hits.items():
                self.events.record(Event(EventKind.HIT, name, name, layer, n * self.block_bytes, now, now, now, n))
        return len(found) - hits.total()

    def prefetch(self, keys: Sequence[BlockKey], tier: str | None = None, *,
                 layer: int | None = None, guess: bool = False) -> None:
        """Start loading ``keys`` into ``tier`` in the background; errors are recorded, not raised.

        ``guess``: the caller may not read them (a speculative selection); they enter the tier
        cold where its policy can (``AdmitsCold``), so an unused one is evicted first.
        """
        self._check_running()
        missing = [k for k in keys if not self._resident(k, tier)]
        if missing:
            self._spawn(self._bring(missing, tier or self.memory_tiers[0], layer, Priority.PREFETCH, cold=guess),
                        quiet=True)

    # -- internals: placement -------------------------------------------
    def _placement(self, tier: str | None) -> list[str]:
        if tier is not None:
            if tier not in self.tiers:
                raise ValueError(f"tier={tier!r}: not configured; tiers: {', '.join(self.order)}")
            return [tier]
        return list(self.order)

    async def _place(self, key: BlockKey, name: str, slot: int, raw: torch.Tensor,
                     layer: int | None) -> None:
        tier = self.tiers[name]
        transfer = Transfer(Kind.PUT, "", name, (key,), (), (slot,), self.block_bytes, layer)
        body = partial(put_handler_for(tier.medium), transfer, raw, tier)
        try:
            await asyncio.shield(self._executor.submit(transfer, body, Priority.NOW))
        except BaseException:
            tier.pool.release(slot)
            self.directory.forget_if_empty(key)
            raise
        self._commit(key, name, slot)

    async def _writeback(self, key: BlockKey, done: asyncio.Future) -> None:
        entry = self.directory.get(key)
        sources = [n for n in self.memory_tiers if entry is not None and n in entry.copies]
        if not sources:  # evicted meanwhile: a protected block was demoted, so it is stored
            self._settle([key], self.store.name, done, None)
            return
        await self._move([key], sources[0], self.store.name, Kind.WRITEBACK, Priority.WRITEBACK, None, done)

    # -- internals: moves -----------------------------------------------
    async def _bring(self, keys: Sequence[BlockKey], dst: str, layer: int | None,
                     priority: Priority, *, cold: bool = False) -> None:
        """Make every key resident in ``dst`` (joining moves already in flight; ``cold``: the
        moves this call starts insert their blocks cold)."""
        joined: list[asyncio.Future] = []
        by_source: dict[str, list[BlockKey]] = {}
        for key in dict.fromkeys(keys):
            entry = self.directory.entry(key)
            if dst in entry.copies:
                continue
            if dst in entry.arriving:
                joined.append(entry.arriving[dst])
                if priority is Priority.NOW:
                    self._executor.boost_moves(key, dst, Priority.NOW)
                continue
            source = next((n for n in self.order if n in entry.copies), None)
            if source is None:
                raise BlockMissing(f"block {key.hex()} is not stored in any tier")
            by_source.setdefault(source, []).append(key)
        kind = Kind.LOAD if priority is Priority.NOW else Kind.PREFETCH
        moves = [self._move(group, src, dst, kind, priority, layer, self._claim(group, dst), cold=cold)
                 for src, group in by_source.items()]
        results = await asyncio.gather(*moves, *(asyncio.shield(f) for f in joined), return_exceptions=True)
        corrupt = [k for r in results if isinstance(r, list) for k in r]
        errors = [r for r in results if isinstance(r, BaseException)]
        if corrupt:
            raise BlockCorrupt(f"{len(corrupt)} block(s) failed their checksum and were dropped: "
                               + ", ".join(k.hex()[:16] for k in corrupt[:4]))
        if errors:
            raise errors[0]

    def _claim(self, keys: Sequence[BlockKey], dst: str) -> asyncio.Future:
        """Announce a move of ``keys`` into ``dst`` (synchronously, so later readers join it)."""
        done = asyncio.get_running_loop().create_future()
        for key in keys:
            self.directory.entry(key).arrive(dst, done)
        return done

    async def _move(self, keys: list[BlockKey], src: str, dst: str, kind: Kind, priority: Priority,
                    layer: int | None, done: asyncio.Future, *, cold: bool = False) -> list[BlockKey]:
        """Copy ``keys`` (claimed by ``done``) from ``src`` to ``dst``; returns keys whose source was corrupt."""
        try:
            dst_slots = await self._reserve(dst, len(keys))
        except BaseException as error:
            self._settle(keys, dst, done, error)
            raise
        entry_of = self.directory.entry
        copies = [entry_of(k).copies for k in keys]
        if any(src not in c for c in copies):  # evicted from the source while we made room: the caller retries
            for slot in dst_slots:
                self.tiers[dst].pool.release(slot)
            self._settle(keys, dst, done, None)
            return []
        src_slots, src_pool = [c[src] for c in copies], self.tiers[src].pool
        for slot in src_slots:
            src_pool.pin(slot)
        wanted = self._wanted.get    # .get: a Counter's [] calls Python code for every absent key
        if any(wanted((k, dst)) for k in keys):
            priority = Priority.NOW  # a caller started waiting while this move was prepared
        transfer = Transfer(kind, src, dst, tuple(keys), tuple(src_slots), tuple(dst_slots),
                            len(keys) * self.block_bytes, layer, cold=cold)
        handler = handler_for(self.tiers[src].medium, self.tiers[dst].medium)
        body = partial(handler, transfer, self.tiers[src], self.tiers[dst])
        work = self._executor.submit(transfer, body, priority)
        work.add_done_callback(lambda w: self._complete(transfer, w, done))
        return await asyncio.shield(done)

    def _complete(self, t: Transfer, work: asyncio.Future, done: asyncio.Future) -> None:
        src_pool = self.tiers[t.src].pool
        for slot in t.src_slots:
            src_pool.unpin(slot)
        error = work.exception()
        failed = set() if error is not None else set(work.result())
        if error is not None:
            for slot in t.dst_slots:
                self.tiers[t.dst].pool.release(slot)
        else:
            self._commit_all(t.keys, t.dst, t.dst_slots, cold=t.cold, skip=failed)
        self.stats[t.src].bytes_out += t.nbytes
        for key in failed:
            self._remove_copy(key, t.src)
            self.policies[t.src].remove(key)
        if error is None and t.kind is Kind.DEMOTE:
            for key, slot in zip(t.keys, t.src_slots):
                if self.tiers[t.src].pool.pins(slot):
                    self._admit(t.src, key)  # a reader pinned it meanwhile: keep this copy
                elif key not in failed:
                    self._remove_copy(key, t.src)  # its policy already forgot it
        self._changed.set()
        self._settle(t.keys, t.dst, done, error, sorted(failed))

    def _settle(self, keys: Sequence[BlockKey], dst: str, done: asyncio.Future,
                error: BaseException | None, failed: list[BlockKey] | None = None) -> None:
        get = self.directory.get
        for key in keys:
            entry = get(key)
            if entry is not None:
                entry.settle(dst, done)
                if not entry.copies and not entry.arriving:
                    self.directory.forget_if_empty(key)
        if done.done():
            return
        if error is None:
            done.set_result(failed or [])
        else:
            done.set_exception(error)
            done.exception()  # retrieved here: callers may have gone away

    # -- internals: room ------------------------------------------------
    async def _reserve(self, name: str, n: int) -> list[int]:
        pool = self.tiers[name].pool
        if n > pool.capacity:
            raise BudgetExceeded(f"tier {name}: {n} blocks requested, the budget holds {pool.capacity}")
        while not pool.can_reserve(n):
            await self._make_room(name, n - pool.free)
        slots = [pool.reserve() for _ in range(n)]
        self.stats[name].peak_slots = max(self.stats[name].peak_slots, pool.used)
        return slots

    async def _make_room(self, name: str, need: int) -> None:
        guard = _Unevictable(self, name)
        victims = self.policies[name].evict(need, guard) or []
        while len(victims) < need and (chosen := self.policies[name].evict(1, guard)):
            victims.extend(chosen)  # fewer than ``need`` can go: take what can
        if not victims:
            if await self._room_may_appear(name):
                return
            raise BudgetExceeded(f"tier {name}: all {self.tiers[name].pool.capacity} slots are pinned or "
                                 "hold the only copy of protected blocks; raise its budget or add a lower tier")
        demote: list[BlockKey] = []
        room_below = self._free_memory_below(name)
        for key in victims:
            entry = self.directory.entry(key)
            only_copy = len(entry.copies) == 1 and entry.protected and self._below(name) is not None
            if only_copy or (len(demote) < room_below and self._below(name) not in entry.copies):
                demote.append(key)  # keep it: below has room (a warm copy) or it is the only copy
            else:
                self._remove_copy(key, name)
                self.directory.forget_if_empty(key)
        if demote:
            await self._demote(demote, name)

    async def _room_may_appear(self, name: str) -> bool:
        """Wait while moves run or slots of ``name`` are pinned or reserved; False when nothing can change."""
        pool = self.tiers[name].pool
        if not (pool.busy_slots() or self._executor.busy):
            return False
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=self.pin_wait_s)
        except TimeoutError:
            return False
        return True

    async def _demote(self, keys: list[BlockKey], name: str) -> None:
        try:
            below = self._below(name)
            await self._move(keys, name, below, Kind.DEMOTE, Priority.NOW, None, self._claim(keys, below))
        except BaseException:
            for key in keys:  # still resident here: give them back to the policy
                if name in self.directory.entry(key).copies:
                    self._admit(name, key)
            raise

    def _free_memory_below(self, name: str) -> int:
        below = self._below(name)
        if below is None or self.tiers[below].medium is Medium.NVME:
            return 0
        return self.tiers[below].pool.free

    def _below(self, name: str) -> str | None:
        index = self.order.index(name)
        return self.order[index + 1] if index + 1 < len(self.order) else None

    def _evictable(self, key: BlockKey, name: str) -> bool:
        entry = self.directory.get(key)
        if entry is None or name not in entry.copies:
            return True  # stale in the policy; evicting it is harmless
        if self.tiers[name].pool.pins(entry.copies[name]) or self._wanted.get((key, name)):
            return False
        last_copy = len(entry.copies) == 1
        return not (entry.protected and last_copy and self._below(name) is None)

    # -- internals: bookkeeping ----------------------------------------
    def _commit(self, key: BlockKey, name: str, slot: int, *, cold: bool = False) -> None:
        self._commit_all((key,), name, (slot,), cold=cold)

    def _commit_all(self, keys: Sequence[BlockKey], name: str, slots: Sequence[int], *, cold: bool = False,
                    skip: Container[BlockKey] = ()) -> None:
        """Make block ``keys[i]`` resident in ``slots[i]`` of ``name`` and admit it to the tier's policy
        (this runs for every block a load brings); ``skip``: keys whose slot is released instead
        (their source failed verification)."""
        pool, entry_of = self.tiers[name].pool, self.directory.entry
        added = []
        for key, slot in zip(keys, slots):
            entry = None if key in skip else entry_of(key)
            if entry is None or name in entry.copies:  # failed, or already there (blocks are immutable)
                pool.release(slot)
                continue
            pool.commit(slot)
            entry.copies[name] = slot
            added.append(key)
        self._admit_all(name, added, cold=cold)
        self.stats[name].bytes_in += len(added) * self.block_bytes

    def _admit(self, name: str, key: BlockKey, *, cold: bool = False) -> None:
        self._admit_all(name, (key,), cold=cold)

    def _admit_all(self, name: str, keys: Sequence[BlockKey], *, cold: bool = False) -> None:
        """Tell ``name``'s policy the blocks are resident (``cold``: on a prefetch's guess), and
        where they sit if the policy asks."""
        policy = self.policies[name]
        if cold and implements(policy, AdmitsCold):
            for key in keys:
                policy.insert_cold(key)
            self._cold.update((key, name) for key in keys)
        else:
            for key in keys:
                policy.insert(key)
        if implements(policy, DescribesBlocks):
            get = self.directory.get
            for key in keys:
                if (entry := get(key)) is not None:
                    policy.describe(key, layer=entry.layer, index=entry.index)

    def _remove_copy(self, key: BlockKey, name: str) -> None:
        self._cold.discard((key, name))
        entry = self.directory.entry(key)
        slot = entry.copies.pop(name)
        tier = self.tiers[name]
        if tier.medium is Medium.NVME:
            tier.drop(key)
        tier.pool.release(slot)

    def _index_persisted(self, name: str) -> None:
        tier = self.tiers[name]
        if tier.medium is not Medium.NVME:
            return
        for key, slot in tier.items():
            self.directory.add(key, protected=False).copies[name] = slot
            self._admit(name, key)
        self.stats[name].peak_slots = tier.pool.used

    def _resident(self, key: BlockKey, tier: str | None) -> bool:
        entry = self.directory.get(key)
        if entry is None:
            return False
        names = [tier] if tier is not None else self.in_place_tiers
        return any(n in entry.copies for n in names)

    def _pin_resident(self, keys: Sequence[BlockKey], tier: str | None,
                      fresh: Container[BlockKey] = ()) -> tuple[tuple[str, int], ...] | None:
        found = self._find(keys, tier)
        return None if None in found else self._pin(keys, found, fresh)

    def _find(self, keys: Sequence[BlockKey], tier: str | None) -> list[tuple[str, int] | None]:
        """Where each key can be read in place: (tier, slot), or None. The hot path of every read:
        one dict lookup per key and tier."""
        names = [tier] if tier is not None else self.in_place_tiers
        get = self.directory.get
        found: list[tuple[str, int] | None] = []
        for key in keys:
            entry = get(key)
            place = None
            if entry is not None:
                copies = entry.copies
                for name in names:
                    slot = copies.get(name)
                    if slot is not None:
                        place = (name, slot)
                        break
            found.append(place)
        return found

    def _pin(self, keys: Sequence[BlockKey], places: Sequence[tuple[str, int]],
             fresh: Container[BlockKey] = ()) -> tuple[tuple[str, int], ...]:
        """Pin every key where ``_find`` found it, and tell the policies of the use."""
        tiers, policies, cold = self.tiers, self.policies, self._cold
        for key, (name, slot) in zip(keys, places):
            tiers[name].pool.pin(slot)
            if (key, name) in cold:  # a guessed block's first use: no longer a guess
                cold.discard((key, name))
                policies[name].touch(key)
            elif key not in fresh:  # a block loaded for this call was just inserted: not a reuse
                policies[name].touch(key)
        return tuple(places)

    def _unpin(self, places: Iterable[tuple[str, int]]) -> None:
        for name, slot in places:
            self.tiers[name].pool.unpin(slot)
        self._changed.set()

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


def _as_bytes(data: torch.Tensor, block_bytes: int) -> torch.Tensor:
    raw = data.contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() != block_bytes:
        raise ValueError(f"block of {raw.numel()} bytes; this manager stores blocks of exactly {block_bytes}")
    return raw
