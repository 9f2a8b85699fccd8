"""The remote tier's two directions, beside the manager's own tiers.

    write-through   a block put with ``persist`` is copied into a bounded queue; one thread sends
                    the queue to the remote in pipelined batches. A full queue or a remote that is
                    unavailable skips the write (counted, logged once): compute never waits for it.
    read on a miss  blocks a caller wants held (a reused prefix, a stored sparse state) and finds
                    nowhere locally are asked of the remote in one round trip, only where the link
                    (measured) brings them faster than the caller could compute them again; the
                    verified ones are placed in the local tiers like new blocks (and persisted to
                    the NVMe store), the rest stay missing (the caller recomputes them).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import asyncio
from typing import TYPE_CHECKING

import torch

from tierkv.errors import BudgetExceeded
from tierkv.keys import BlockKey
from tierkv.tiers.remote import RemoteStore

if TYPE_CHECKING:
    from tierkv.manager.manager import TierManager

log = logging.getLogger(__name__)
BATCH_BYTES = 8 * 1024**2


@dataclass(slots=True)
class Recompute:
    """What computing a block again costs the caller, in seconds; set by the engine that owns the blocks."""
    seconds_per_block: float

    def worth_fetching(self, remote: RemoteStore, blocks: int, block_bytes: int) -> bool:
        link = remote.measured_link()
        return link is None or link.read_s(blocks * block_bytes) < blocks * self.seconds_per_block


class WriteThrough:
    """A bounded queue of (key, bytes) sent to ``remote`` by one daemon thread."""

    def __init__(self, remote: RemoteStore, max_bytes: int = 256 * 1024**2) -> None:
        self.remote, self.max_bytes = remote, max_bytes
        self._queue: deque[tuple[BlockKey, bytes]] = deque()
        self._bytes = 0
        self._sending = 0
        self._cond = threading.Condition()
        self._closed = False
        self._warned_full = False
        self._thread = threading.Thread(target=self._run, name="tierkv-remote", daemon=True)
        self._thread.start()

    def offer(self, key: BlockKey, payload: bytes) -> bool:
        """Queue a block for the remote; False (skipped, counted) when the queue is full or the remote
        is unavailable. Never blocks."""
        if not self.remote.available:
            self.remote.stats.skipped += 1
            return False
        with self._cond:
            if self._closed or self._bytes + len(payload) > self.max_bytes:
                self.remote.stats.skipped += 1
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("remote store %s: write-through queue full (%d MiB); skipping writes until it "
                                "drains", self.remote.name, self.max_bytes >> 20)
                return False
            self._queue.append((key, payload))
            self._bytes += len(payload)
            self._cond.notify()
        return True

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block was sent (or skipped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._sending, timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self.drain(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, size = [], 0
                while self._queue and size < BATCH_BYTES:
                    key, payload = self._queue.popleft()
                    batch.append((key, payload))
                    size += len(payload)
                self._bytes -= size
                self._sending = len(batch)
            try:
                if self.remote.available:
                    self.remote.put_many(batch)
                else:
                    self.remote.stats.skipped += len(batch)
            except Exception:    # a bug must not kill the thread that drains the queue
                log.exception("remote store %s: write-through failed", self.remote.name)
                self.remote.stats.skipped += len(batch)
            finally:
                with self._cond:
                    self._sending = 0
                    if not self._queue:
                        self._warned_full = False
                    self._cond.notify_all()


def read_missing(remote: RemoteStore, keys: Sequence[BlockKey], block_bytes: int,
                 recompute: Recompute | None) -> list[tuple[BlockKey, bytes]]:
    """The verified blocks of ``keys`` the remote holds, where reading them beats recomputing them."""
    if not keys or not remote.available:
        return []
    if recompute is not None and not recompute.worth_fetching(remote, len(keys), block_bytes):
        remote.stats.slower += len(keys)
        return []
    return [(k, p) for k, p in zip(keys, remote.get_many(keys, block_bytes)) if p is not None]


async def hold_or_fetch(manager: TierManager, keys: Sequence[BlockKey]) -> list[BlockKey]:
    """``manager.hold``, reading the blocks stored nowhere locally from its remote store first (where that
    beats recomputing them); returns the keys still missing."""
    missing = manager.hold(keys)
    if not missing or manager.remote is None:
        return missing
    fetched = await asyncio.to_thread(read_missing, manager.remote, missing, manager.block_bytes, manager.recompute)
    placed = []
    for key, payload in fetched:
        try:
            await manager.put(key, torch.frombuffer(bytearray(payload), dtype=torch.uint8), protect=False,
                              persist=manager.store is not None, share=False)
        except BudgetExceeded:
            break            # no room left locally: the rest are recomputed
        placed.append(key)
    still = manager.hold(placed)
    gone = set(placed)
    return [k for k in missing if k not in gone] + still
