"""A blocking facade over the tier manager for synchronous callers.

A model's forward pass is synchronous; it talks to a manager whose event
loop runs on a thread of its own. Each call hops to that loop and waits::

    caller thread                 loop thread
    mgr.acquire(keys) ───run──▶   await TierManager.acquire(keys)
         ◀──── Lease ───────────  (pinned views)
    lease.release() ──queue──▶    unpin, before the next call runs (or within UNPIN_TICK_S)
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from itertools import compress
from typing import Any, TypeVar

import numpy as np
import torch

from tierkv.config import TierConfig
from tierkv.errors import ManagerClosed
from tierkv.knobs import IOKnobs
from tierkv.keys import BlockKey
from tierkv.manager.lease import shared_space, space_rows
from tierkv.manager.read_future import ReadFuture, packed_rows, thread_future
from tierkv.manager.manager import Lease, TierManager
from tierkv.manager.residency import by_tier, touch_all
from tierkv.manager.unpinned import read_unpinned
from tierkv.manager.remote import Recompute, hold_or_fetch
from tierkv.tiers.base import Tier
from tierkv.tiers.memory import HostSpace
from tierkv.tiers.remote import RemoteStore
from tierkv.events import AccessHook, EventRecorder

T = TypeVar("T")
UNPIN_TICK_S = 0.01   # the loop unpins released blocks at least this often when no caller asks it anything


class BlockingTierManager:
    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self._loop = asyncio.new_event_loop()
        self._ends_itself = False             # set by `close_later`: the loop's thread closes the loop
        self._thread = threading.Thread(target=self._serve, name="tierkv-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._released: deque[Any] = deque()   # places callers let go of, not yet unpinned on the loop
        self._dropped: deque[list[BlockKey]] = deque()   # blocks let go of by `drop_later`, not yet dropped
        self._used: deque[tuple[str, Sequence[BlockKey]]] = deque()   # blocks lent unpinned, not yet touched
        try:
            self._run(manager.start())
            self._loop.call_soon_threadsafe(self._tick)
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def from_config(cls, config: TierConfig, *, namespace: str = "default", knobs: IOKnobs | None = None,
                    recorder: EventRecorder | None = None) -> BlockingTierManager:
        return cls(TierManager.from_config(config, namespace=namespace, knobs=knobs, recorder=recorder))

    @functools.cached_property
    def space(self) -> HostSpace | None:
        """The ``HostSpace`` every memory tier lies in, or None: where there is one, a packed read that
        may lend lends its blocks where they lie, those it loads too (see ``read``)."""
        mgr = self.manager
        return shared_space(mgr.tiers[name] for name in mgr.memory_tiers)

    # -- calls ----------------------------------------------------------
    def pin_group(self, tier: str | None = None) -> int:
        """Blocks a caller pins at once: half of ``tier`` (default the fastest memory tier), so a
        prefetch fits beside them."""
        mgr = self.manager
        return max(1, mgr.tiers[tier or mgr.memory_tiers[0]].pool.capacity // 2)

    def put(self, key: BlockKey, data: torch.Tensor, **kw: Any) -> None:
        self._run(self.manager.put(key, data, **kw))

    def put_many(self, keys: Sequence[BlockKey], rows: torch.Tensor, *, layer: int | None = None,
                 first_index: int | None = None, persist: bool = False) -> None:
        """``put`` block ``keys[i]`` with the bytes of ``rows[i]``, in one hop to the loop thread and one
        placement (see `TierManager.put_many`); block i gets index ``first_index + i``."""
        self._run(self.manager.put_many(keys, rows, layer=layer, first_index=first_index, persist=persist))

    def acquire(self, keys: Sequence[BlockKey], tier: str | None = None, **kw: Any) -> Lease:
        kw.setdefault("thread", threading.get_ident())      # the wait is this thread's
        return self._callers(self._run(self.manager.acquire(keys, tier, **kw),
                                       undo=lambda lease: self._callers(lease).release()))

    @contextmanager
    def blocks(self, keys: Sequence[BlockKey], tier: str | None = None, **kw: Any) -> Iterator[tuple[torch.Tensor, ...]]:
        lease = self.acquire(keys, tier, **kw)
        try:
            yield lease.views
        finally:
            lease.release()

    def read(self, keys: Sequence[BlockKey], *, into: torch.Tensor, tier: str | None = None,
             layer: int | None = None, lend: bool = False, pin: bool = True,
             rows: np.ndarray | None = None, packed: bool = False) -> ReadFuture:
        """Read blocks ``keys`` into rows of ``into`` (uint8 [len(keys), block_bytes]), in one hop to the
        loop: the blocks in memory are copied before this returns (one tier gather per tier), the rest
        start loading, and ``ReadFuture.wait()`` copies them in. ``mgr.read(keys, into=rows).wait()``
        is a plain blocking read. ``lend``: where every block is in memory, in one extent of a host
        tier, nothing is copied and the future lends them (``ReadFuture.lease``, ``.extent``).

        ``packed``: where the blocks are copied and lie in several tiers or some are loading, the rows of
        ``into`` go to the blocks in memory first, a run per tier, then to those loading
        (``ReadFuture.placed``: each key's row): runs are copied at memory speed, rows scattered among
        others at half of it. ``lend`` and ``packed`` where every memory tier lies in one ``HostSpace``
        (``space``): nothing is copied; ``ReadFuture.extent`` gives each block's row of the space
        (-1: loading, filled in by ``wait``), ``lease`` holds those in memory, and ``ReadFuture.release``
        lets go of those ``wait`` lent.

        ``pin=False``: the blocks are found on this thread, with no hop and no pin. With ``lend``,
        where every block lies in one extent of the first tier read in place, they are lent as a
        ``Lent``, whose ``release()`` says whether they stayed put while they were read (False: read
        again, pinned). With ``packed``, where some are in no tier read in place, those start loading
        in a hop this thread does not wait for, and the others are copied here meanwhile, each checked
        by its slot's generation (freed meanwhile: the pinned read instead). Otherwise, or while an
        access hook records the reads, it is the pinned read. ``rows``: each key's directory row as an
        earlier such read found it (``ReadFuture.rows``; -1: not known), a guess checked against the
        keys that spares their lookup."""
        if len(into) < len(keys):
            raise ValueError(f"read of {len(keys)} block(s) into {len(into)} row(s): `into` needs a row for each key")
        if not pin and (lend or packed):
            future = read_unpinned(self, keys, into, tier, layer, rows, lend=lend, packed=packed)
            if future is not None:
                return future
        async def begin() -> tuple[list[int], Lease, Future | None]:
            ready, lease, rest = await self.manager.read(keys, tier, layer=layer)
            return ready, lease, None if rest is None else thread_future(rest)
        ready, lease, pending = self._run(begin())
        if len(ready) == len(keys):
            missing = []
        else:
            in_place = set(ready)
            missing = [i for i in range(len(keys)) if i not in in_place]
        future = ReadFuture(self, into, ready, missing, pending, tier, layer)
        lease = self._callers(lease)
        if packed:
            future.placed = packed_rows(lease.places, ready, missing)
        space = self.space if lend and packed else None
        if space is not None:           # lent where they lie, the loading ones too once they arrive
            at = np.full(len(keys), -1, np.int64)
            try:
                at[ready] = space_rows(self.manager.tiers, lease.places)
            except BaseException:
                lease.release()
                future.cancel()
                raise
            future.extent, future.lease = (space.rows(), at), lease
            return future
        if lend and not missing:
            try:
                future.extent = lease.in_place()
            except BaseException:
                lease.release()
                raise
            if future.extent is not None:
                future.lease = lease
                return future
        try:
            self._copy_out(lease, into, ready if future.placed is None else future.placed[ready].tolist())
        except BaseException:
            future.cancel()
            raise
        return future

    def _record_hits(self, hits: list[tuple[str, int]], layer: int | None) -> None:
        """A ``hit`` event per (tier, blocks) of a read lent unpinned, once its check passed."""
        for name, blocks in hits:
            self.manager.record_hits(name, blocks, layer)

    def copy_out(self, lease: Lease, out: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Copy ``lease``'s blocks into ``out`` [n, block_bytes], block i into row i (or ``rows[i]``,
        ascending), one tier gather per tier. The lease stays the caller's to release."""
        places, tiers = lease.places, self.manager.tiers
        if not places:
            return
        at = list(range(len(places))) if rows is None else list(rows)
        if len(at) != len(places) or at[-1] >= len(out):
            raise ValueError(f"{len(places)} block(s) into rows {at[:4]}{'...' if len(at) > 4 else ''} of "
                             f"{len(out)}: expected one row of the destination for each block")
        for name, (slots, mine) in by_tier(places).items():
            if mine is None and len(slots) == len(out):     # every row, in order
                tiers[name].gather(slots, out)
            else:
                tiers[name].gather(slots, out, at if mine is None else list(compress(at, mine)))

    def _copy_out(self, lease: Lease, out: torch.Tensor, rows: Sequence[int]) -> None:
        """``copy_out``, then release the lease."""
        try:
            self.copy_out(lease, out, rows)
        finally:
            lease.release()

    def prefetch(self, keys: Sequence[BlockKey], tier: str | None = None, *, layer: int | None = None,
                 guess: bool = False) -> None:
        self._loop.call_soon_threadsafe(lambda: self.manager.prefetch(keys, tier, layer=layer, guess=guess))

    def observe(self, scores: Sequence[tuple[BlockKey, float]]) -> None:
        """Attention mass per block (fire and forget: policies change on the loop thread)."""
        self._loop.call_soon_threadsafe(self.manager.observe, scores)

    @property
    def wants_scores(self) -> bool:
        return self.manager.wants_scores

    # -- what callers look at (set at start, read from any thread) --------
    @property
    def events(self) -> EventRecorder:
        return self.manager.events

    @property
    def access(self) -> AccessHook | None:
        """The hook told of every put and read (an access recorder), or None."""
        return self.manager.access

    @property
    def remote(self) -> RemoteStore | None:
        return self.manager.remote

    @property
    def has_store(self) -> bool:
        """An NVMe store holds blocks past this process."""
        return self.manager.store is not None

    @property
    def persists(self) -> bool:
        """Blocks outlive this process: an NVMe store or a remote one holds them."""
        return self.manager.store is not None or self.manager.remote is not None

    def price_recompute(self, recompute: Recompute) -> None:
        """What recomputing a block costs, against which a remote read is weighed (only with a remote)."""
        self.manager.recompute = recompute

    def tier(self, name: str) -> Tier | None:
        return self.manager.tiers.get(name)

    def tier_stats(self) -> dict[str, dict[str, object]]:
        """Per tier, fastest first: budget, peak and final bytes, bytes read out and written in."""
        mgr = self.manager
        return {name: {"budget_bytes": mgr.tiers[name].budget_bytes,
                       "peak_bytes": mgr.stats[name].peak_slots * mgr.block_bytes,
                       "final_bytes": mgr.used_bytes(name), "bytes_read": mgr.stats[name].bytes_out,
                       "bytes_written": mgr.stats[name].bytes_in} for name in mgr.order}

    def busy_blocks(self) -> int:
        """Blocks pinned or reserved in any tier now (0 once nothing reads or moves)."""
        mgr = self.manager
        return self._call(lambda: sum(mgr.tiers[name].pool.busy_slots() for name in mgr.order))

    def held_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self._call(self.manager.directory.held_count)

    def persist(self, keys: Sequence[BlockKey]) -> None:
        self._call(self.manager.persist, keys)

    def protect(self, keys: Sequence[BlockKey], *, remote: bool = True) -> bool:
        """Hold all of ``keys`` (reading those stored nowhere locally from the remote store, if any, and
        ``remote``), or none of them: False where one is missing."""
        if self.manager.remote is None or not remote:
            return self._call(self.manager.protect, keys)
        missing = self.hold(keys)
        if missing:
            gone = set(missing)
            self.unprotect([key for key in keys if key not in gone])
        return not missing

    def hold(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        if self.manager.remote is None:
            return self._call(self.manager.hold, keys)
        return self._run(hold_or_fetch(self.manager, keys))

    def scrub(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        return self._run(self.manager.scrub(keys))

    def unprotect(self, keys: Sequence[BlockKey]) -> None:
        self._call(self.manager.unprotect, keys)

    def flush(self) -> None:
        self._run(self.manager.flush())

    def drop(self, keys: Sequence[BlockKey]) -> None:
        self._run(self.manager.drop(keys))

    def rows(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Each key's row in the directory now (-1: stored nowhere): guesses for ``read``'s ``rows``."""
        return self._call(self.manager.directory.find_rows, keys)

    def contains(self, key: BlockKey) -> bool:
        return self._call(self.manager.contains, key)

    def where(self, key: BlockKey) -> list[str]:
        return self._call(self.manager.where, key)

    def _callers(self, lease: Lease) -> Lease:
        """``lease``, made on the loop thread, for this thread: its release hops back to the loop."""
        lease.unpin = self._unpin
        return lease

    def _unpin(self, places: Any) -> None:
        """Queued, not sent: the loop unpins them before anything a caller asks for later, and on its own
        every ``UNPIN_TICK_S``. Waking the loop for each release would make this thread wait for the
        interpreter's lock while the loop works (one wake per layer read, ~1 ms each on two cores)."""
        self._released.append(places)

    def drop_later(self, keys: Sequence[BlockKey]) -> None:
        """``drop`` without waiting for it, from any thread, a finalizer's included (which may run on the
        loop's own thread, where waiting for the loop never ends): queued, and dropped on the loop before
        anything asked later."""
        self._dropped.append(list(keys))

    def _unpin_released(self) -> None:
        """On the loop: unpin what callers released, and tell the policies of the blocks lent unpinned
        (deques: appends from other threads are never lost)."""
        released, used = self._released, self._used
        while released:
            self.manager._unpin(released.popleft())
        while used:
            name, keys = used.popleft()
            touch_all(self.manager.policies[name], keys)

    async def _drop_queued(self) -> None:
        while self._dropped:
            await self.manager.drop(self._dropped.popleft())

    def _tick(self) -> None:
        self._unpin_released()
        if self._dropped:
            self.manager._spawn(self._drop_queued(), quiet=True)
        if not self._closed:
            self._loop.call_later(UNPIN_TICK_S, self._tick)

    # -- lifecycle ------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.manager.aclose())
        finally:
            self._stop_loop()

    def close_later(self) -> None:
        """``close`` without waiting for it, from any thread, a finalizer's included: the loop drops what
        `drop_later` queued, closes the tiers, and ends (no thread is started or waited for: a finalizer
        may run on the loop's own thread, or as the interpreter exits)."""
        if self._closed:
            return
        self._closed, self._ends_itself = True, True

        async def close() -> None:
            try:
                await self._drop_queued()
                await self.manager.aclose()
            finally:
                self._loop.stop()
        with contextlib.suppress(RuntimeError):           # its loop has ended already
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(close()))

    def _serve(self) -> None:
        self._loop.run_forever()
        if self._ends_itself:                 # stopped by `close_later`: nobody joins this thread to close it
            self._loop.close()

    def __enter__(self) -> BlockingTierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], undo: Callable[[T], None] | None = None) -> T:
        """``coro`` run on the loop; its result. ``undo``: where this thread is interrupted while it waits
        (Ctrl-C, SIGTERM), the loop's work is waited for and its result given to ``undo`` (a lease
        released) before the interruption goes on: a pin nobody holds would fail the drops that follow."""
        if sys.is_finalizing():   # the loop's thread stops at its next step: a wait for it would never end
            if asyncio.iscoroutine(coro):
                coro.close()
            raise ManagerClosed("the interpreter is exiting: the tier manager no longer runs")
        work = self._after_releases(coro)
        try:
            submitted = asyncio.run_coroutine_threadsafe(work, self._loop)
        except RuntimeError:                  # its loop has stopped: closed
            work.close()
            if asyncio.iscoroutine(coro):
                coro.close()
            if not self._loop.is_closed():
                raise
            raise ManagerClosed("the tier manager is closed: make a new one") from None
        try:
            return submitted.result()
        except BaseException:
            if undo is not None:
                try:
                    done = submitted.result()
                except BaseException:       # the work failed (or a second signal came): nothing to undo
                    pass
                else:
                    undo(done)
            raise

    async def _after_releases(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        self._unpin_released()    # what this thread released before it asked
        if self._dropped:
            await self._drop_queued()
        return await coro

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` run on the loop thread (a consistent look at the manager's state)."""
        return self._call(fn, *args)

    def _call(self, fn: Any, *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)
        return self._run(call())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
