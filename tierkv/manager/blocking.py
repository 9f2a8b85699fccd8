"""A blocking facade over the tier manager for synchronous callers.

A model's forward pass is synchronous; it talks to a manager whose event
loop runs on a thread of its own. Each call hops to that loop and waits::

    caller thread                 loop thread
    mgr.acquire(keys) ───run──▶   await TierManager.acquire(keys)
         ◀──── Lease ───────────  (pinned views)
    lease.release() ───call──▶    unpin
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from tierkv.config import IOKnobs, TierConfig
from tierkv.keys import BlockKey
from tierkv.manager.manager import Lease, TierManager
from tierkv.manager.transfer import Priority
from tierkv.profile.events import EventRecorder

T = TypeVar("T")


class BlockingTierManager:
    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierkv-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._run(manager.start())
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def from_config(cls, config: TierConfig, *, namespace: str = "default", knobs: IOKnobs | None = None,
                    recorder: EventRecorder | None = None) -> BlockingTierManager:
        return cls(TierManager.from_config(config, namespace=namespace, knobs=knobs, recorder=recorder))

    # -- calls ----------------------------------------------------------
    def put(self, key: BlockKey, data: torch.Tensor, **kw: Any) -> None:
        self._run(self.manager.put(key, data, **kw))

    def put_many(self, items: Sequence[tuple[BlockKey, torch.Tensor]], *, layer: int | None = None,
                 first_index: int | None = None, persist: bool = False) -> None:
        """``put`` each (key, data) in order, in one hop to the loop thread; block i gets index
        ``first_index + i``."""
        async def put_all() -> None:
            for i, (key, data) in enumerate(items):
                index = None if first_index is None else first_index + i
                await self.manager.put(key, data, layer=layer, index=index, persist=persist)
        self._run(put_all())

    def acquire(self, keys: Sequence[BlockKey], tier: str | None = None, **kw: Any) -> Lease:
        lease = self._run(self.manager.acquire(keys, tier, **kw))
        lease.unpin = self._unpin  # release hops back to the loop thread
        return lease

    @contextmanager
    def blocks(self, keys: Sequence[BlockKey], tier: str | None = None, **kw: Any) -> Iterator[tuple[torch.Tensor, ...]]:
        lease = self.acquire(keys, tier, **kw)
        try:
            yield lease.views
        finally:
            lease.release()

    def gather(self, keys: Sequence[BlockKey], out: torch.Tensor, tier: str | None = None, **kw: Any) -> torch.Tensor:
        """Copy the blocks ``keys`` into ``out`` (uint8 [len(keys), block_bytes]), one tier gather per tier."""
        lease = self.acquire(keys, tier, **kw)
        try:
            by_tier: dict[str, list[tuple[int, int]]] = {}
            for row, (name, slot) in enumerate(lease.places):
                by_tier.setdefault(name, []).append((row, slot))
            tiers = self.manager.tiers
            for name, rows in by_tier.items():
                if len(rows) == len(keys):
                    tiers[name].gather([slot for _, slot in rows], out)
                else:
                    tiers[name].gather([slot for _, slot in rows], out, [row for row, _ in rows])
        finally:
            lease.release()
        return out

    def prefetch(self, keys: Sequence[BlockKey], tier: str | None = None, *, layer: int | None = None,
                 guess: bool = False) -> None:
        self._loop.call_soon_threadsafe(lambda: self.manager.prefetch(keys, tier, layer=layer, guess=guess))

    def observe(self, scores: Sequence[tuple[BlockKey, float]]) -> None:
        """Attention mass per block (fire and forget: policies change on the loop thread)."""
        self._loop.call_soon_threadsafe(self.manager.observe, scores)

    @property
    def wants_scores(self) -> bool:
        return self.manager.wants_scores

    def persist(self, keys: Sequence[BlockKey]) -> None:
        self._call(self.manager.persist, keys)

    def protect(self, keys: Sequence[BlockKey]) -> bool:
        return self._call(self.manager.protect, keys)

    def unprotect(self, keys: Sequence[BlockKey]) -> None:
        self._call(self.manager.unprotect, keys)

    def flush(self) -> None:
        self._run(self.manager.flush())

    def drop(self, keys: Sequence[BlockKey]) -> None:
        self._run(self.manager.drop(keys))

    def contains(self, key: BlockKey) -> bool:
        return self._call(self.manager.contains, key)

    def where(self, key: BlockKey) -> list[str]:
        return self._call(self.manager.where, key)

    def _unpin(self, places: Any) -> None:
        """Fire and forget: the loop runs it before anything this thread asks for later."""
        self._loop.call_soon_threadsafe(self.manager._unpin, places)

    # -- lifecycle ------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.manager.aclose())
        finally:
            self._stop_loop()

    def __enter__(self) -> BlockingTierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T] | Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call(self, fn: Any, *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)
        return self._run(call())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
