"""A read's future: blocks read into rows of a caller's tensor, some now and the rest as they load.

`BlockingTierManager.read` makes one; what it holds, for keys a b c d e with b and d in memory::

    ready    [1, 3]        copied into their rows before ``read`` returned (or lent in place)
    missing  [0, 2, 4]     loading; ``wait()`` copies them in once the load's lease arrives
    placed   None          row i holds key i; packed: [2, 0, 3, 1, 4] (the ready first, a run per tier)
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv.manager.lease import Lease, Lent, Watched, space_rows

if TYPE_CHECKING:
    from tierkv.manager.blocking import BlockingTierManager


def packed_rows(places: Sequence[tuple[str, int]], ready: list[int], missing: list[int]) -> np.ndarray | None:
    """Each key's row of a packed read: the blocks in place first, a run per tier in the order the keys
    name them, then the missing ones; None where that is every key's own row."""
    names = list(map(itemgetter(0), places))
    tiers = list(dict.fromkeys(names))
    if len(tiers) <= 1 and not missing:
        return None
    at = np.asarray(ready, np.int64)
    if len(tiers) > 1:
        code = np.fromiter(map({name: i for i, name in enumerate(tiers)}.__getitem__, names), np.int64, len(names))
        at = at[np.argsort(code, kind="stable")]
    placed = np.empty(len(ready) + len(missing), np.int64)
    placed[at] = np.arange(len(at))
    placed[np.asarray(missing, np.int64)] = np.arange(len(at), len(placed))
    return placed


def thread_future(task: asyncio.Future) -> Future:
    """A concurrent future that another thread can wait on, completed with ``task``."""
    out: Future = Future()

    def settle(done: asyncio.Future) -> None:
        if done.cancelled():      # (``out`` is running: ``out.cancel()`` would leave it so, and its waiters waiting)
            out.set_exception(CancelledError())
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())
    out.set_running_or_notify_cancel()
    task.add_done_callback(settle)
    return out


class ReadFuture:
    """Blocks read into rows of a caller's tensor, in the style of kvikio's ``IOFuture``::

        f = mgr.read(keys, into=rows)     # rows of the blocks in memory are copied before it returns
        f.ready, f.missing                # positions in keys: in place / still loading (ascending)
        f.wait()                          # every row in place; the time it blocked is recorded as a stall
        f.cancel()                        # not waiting: what is loading is released as it arrives

    A future is waited or cancelled once; a later call does nothing. A read that may lend
    (``read(..., lend=True)``) and finds every block in one extent of a host tier copies nothing:
    ``f.lease`` holds them pinned, ``f.extent`` is where they lie (``Lease.in_place``), and the
    caller reads them there and releases the lease. A packed read (``read(..., packed=True)``)
    puts block i in row ``f.placed[i]`` of ``into`` (None: row i).

    A packed read that may lend, where every memory tier lies in one ``HostSpace``, copies nothing
    at all: ``f.extent`` is (the space's rows, each key's row in it, -1 while it loads), ``f.lease``
    holds the blocks found in memory, and ``wait()`` fills in the rows of the rest, which stay pinned
    until ``f.release()``::

        f = mgr.read(keys, into=rows, lend=True, packed=True)
        space, at = f.extent               # read rows space[at[i]] where at[i] >= 0, then f.lease.release()
        f.wait(); read the rest; f.release()
    """

    def __init__(self, manager: BlockingTierManager, into: torch.Tensor, ready: list[int], missing: list[int],
                 pending: Future | None, tier: str | None, layer: int | None) -> None:
        self.ready, self.missing = ready, missing
        self._manager, self._into, self._pending, self._tier, self._layer = manager, into, pending, tier, layer
        self.lease: Lease | Lent | Watched | None = None
        self.extent: tuple[torch.Tensor, np.ndarray] | None = None
        self.rows: np.ndarray | None = None     # the keys' directory rows, where a read without pins found them
        self.placed: np.ndarray | None = None   # each key's row of ``into`` (packed reads; None: row i)
        self._loaded: Lease | None = None       # what ``wait`` lent in place, until ``release``

    def done(self) -> bool:
        """Nothing is left loading (or it was waited for, or cancelled)."""
        return self._pending is None or self._pending.done()

    def wait(self) -> torch.Tensor:
        """Copy the missing rows in once they are loaded; returns the tensor read into. Raises what the
        load raised (BlockMissing, BlockCorrupt, BudgetExceeded)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._into
        mgr = self._manager.manager
        start = time.perf_counter()
        try:
            lease = pending.result()
        except BaseException:
            pending.add_done_callback(self._release)     # interrupted: release the blocks when they arrive
            raise
        lease = self._manager._callers(lease)
        try:
            mgr.events.wait("", self._tier or mgr.memory_tiers[0], self._layer,
                            len(self.missing) * mgr.block_bytes, start, len(self.missing))
            if self.extent is not None:           # lent in place: these too, pinned until ``release``
                self.extent[1][self.missing] = space_rows(mgr.tiers, lease.places)
                self._loaded = lease
                return self._into
        except BaseException:
            lease.release()
            raise
        rows = self.missing if self.placed is None else self.placed[self.missing].tolist()
        self._manager._copy_out(lease, self._into, rows)
        return self._into

    def release(self) -> None:
        """Unpin the blocks ``wait`` lent in place (a read that lent some: see ``extent``)."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            loaded.release()

    def cancel(self) -> None:
        """The caller will not wait: the missing blocks are released whenever they arrive (and those
        ``wait`` lent in place, now)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.add_done_callback(self._release)
        self.release()

    def _release(self, pending: Future) -> None:
        if not pending.cancelled() and pending.exception() is None:
            self._manager._callers(pending.result()).release()
