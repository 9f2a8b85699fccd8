"""The replay's simulated machine: tiers that keep no bytes, transfers that take modelled time, a virtual clock.

The replayed `TierManager` is the real one; only what lies under it is
simulated::

    TierManager ──▶ Executor ──run──▶ ModelledRunner ──▶ TierModel: done at virtual t
        │                             (body inline: indexes only)
        └── SimArena / SimStore: slots and an index, no bytes
    all on a VirtualLoop: waiting for a timer advances the clock instead of sleeping

Each channel has a busy-until clock: a transfer starts when its channel is
free and ends when the model says (`tierkv.tune.tier_model`)::

    channel nvme  |==load L3==|=writeback=|====load L4====|
    caller        [compute L2]..stall..[compute L3][compute L4]
                                     ^ acquire of L3 returns

Transfers through a CXL pool also record its ``queue`` and ``link`` slices, as
a real run does; near-memory selections are not in access traces, so a replay
has no ``compute`` slices.
"""
from __future__ import annotations

import asyncio
import selectors

import torch

from tierkv.errors import ConfigError, TierKVError
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.keys import BlockKey
from tierkv.manager.executor import Finish, Job
from tierkv.manager.transfer import Transfer
from tierkv.profile.access_trace import TierSpec
from tierkv.tiers.base import Medium
from tierkv.tiers.nvme_view import Changes
from tierkv.tiers.pool import BlockPool
from tierkv.tune.tier_model import TierModel

_THREAD_WAIT_S = 60.0  # nothing scheduled: only a worker thread (asyncio.to_thread) can still wake the loop


class ReplayStalled(TierKVError):
    """The replayed manager waits for something that can never happen."""


# -- tiers without bytes ------------------------------------------------------------------
class SimArena:
    """A memory tier with slots and no bytes: every slot views one shared scratch block."""

    def __init__(self, spec: TierSpec, block_bytes: int, scratch: torch.Tensor) -> None:
        self.name, self.medium, self.device = spec.name, Medium(spec.medium), scratch.device
        self.reads_in_place = self.medium is not Medium.CXL   # as the real pool: reads load out of it
        self.block_bytes = block_bytes
        self.pool = BlockPool(spec.slots)
        self._scratch = scratch

    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    def view(self, slot: int) -> torch.Tensor:
        return self._scratch

    def buffers(self, slots: list[int]) -> list[torch.Tensor]:
        return [self._scratch] * len(slots)

    def gather(self, slots: list[int], out: torch.Tensor, rows: list[int] | None = None) -> None:
        pass

    def scatter(self, slots: list[int], src: torch.Tensor) -> None:
        pass

    def copy_slots(self, slots: list[int], dst: SimArena, dst_slots: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class SimStore:
    """The NVMe store's interface over an index and no files."""

    medium = Medium.NVME
    backend = "sim"

    def __init__(self, spec: TierSpec, block_bytes: int) -> None:
        self.name, self.block_bytes = spec.name, block_bytes
        self.pool = BlockPool(spec.slots)
        self._index: dict[BlockKey, int] = {}

    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    def seed(self, keys: list[BlockKey]) -> None:
        self._index = {key: slot for slot, key in enumerate(keys)}
        self.pool.restore(list(self._index.values()))

    def lookup(self, key: BlockKey) -> int | None:
        return self._index.get(key)

    def items(self) -> list[tuple[BlockKey, int]]:
        return list(self._index.items())

    def keys_and_slots(self) -> tuple[list[BlockKey], list[int]]:
        return list(self._index), list(self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    def write(self, items: list[tuple[BlockKey, int, torch.Tensor]], *, priority: int = 0,
              aligned: bool = False) -> None:
        self._index.update((key, slot) for key, slot, _ in items)

    def read(self, items: list[tuple[BlockKey, int, torch.Tensor]], *, priority: int = 0,
             aligned: bool = False) -> list[BlockKey]:
        return [key for key, slot, _ in items if self._index.get(key) != slot]

    def drop(self, key: BlockKey, slot: int | None = None) -> None:
        """As `NvmeTier.drop`: ``slot`` given, only where the key is still in that slot."""
        if slot is None or self._index.get(key) == slot:
            self._index.pop(key, None)

    def refresh(self) -> Changes:
        """Nothing changes behind a replay's back: no other process shares a simulated store."""
        return Changes()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- virtual time --------------------------------------------------------------------------
class _VirtualSelector(selectors.SelectSelector):
    """Waiting for a timer advances the clock instead of sleeping; worker threads are really waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            ready = super().select(_THREAD_WAIT_S)
            if not ready:
                raise ReplayStalled("replay stalled: the manager waits with no transfer, timer or thread "
                                    "left that could wake it")
            return ready
        self.now += max(timeout, 0.0)
        return super().select(0)


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when everything waits for a timer."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


# -- transfers in modelled time ----------------------------------------------------------
class ModelledRunner:
    """The executor's runner for a replay: transfers take modelled, virtual time.

    A body runs inline when its transfer starts (the tiers hold no bytes, so it
    only updates indexes); it finishes when the link model says the bytes would
    have arrived.
    """

    def __init__(self, model: TierModel, recorder: EventRecorder, pools: frozenset[str] = frozenset()) -> None:
        self.model = model
        self.recorder = recorder
        self.pools = pools   # CXL pool tiers: their transfers also record queue and link slices
        self._busy_until: dict[str, float] = {}

    @staticmethod
    def clock() -> float:
        return asyncio.get_running_loop().time()

    def start(self) -> None:
        pass

    def run(self, job: Job, finish: Finish) -> None:
        loop = asyncio.get_running_loop()
        job.start = loop.time()
        try:
            result, error = job.body(), None
        except Exception as exc:  # a failed transfer, as a worker thread would report it
            result, error = None, exc
        try:
            done_at = self._done_at(job.transfer, job.start)
        except ConfigError as exc:    # a link the model lacks: the transfer fails with it, and the replay
            done_at, result, error = job.start, None, exc
        loop.call_at(done_at, finish, job, result, error)

    def close(self) -> None:
        pass

    def _done_at(self, t: Transfer, now: float) -> float:
        src = t.src or "new"
        link = self.model.link(src, t.dst)
        channel = link.channel or f"{src}->{t.dst}"
        begin = max(now, self._busy_until.get(channel, 0.0))
        self._busy_until[channel] = begin + link.seconds(t.nbytes, len(t.keys))
        if self.pools & {src, t.dst}:
            self._record_pool(t, src, now, begin, self._busy_until[channel])
        return self._busy_until[channel] + self.model.overhead_us * 1e-6

    def _record_pool(self, t: Transfer, src: str, now: float, begin: float, done: float) -> None:
        if begin > now:
            self.recorder.record(Event(EventKind.QUEUE, src, t.dst, t.layer, t.nbytes, now, now, begin, len(t.keys)))
        self.recorder.record(Event(EventKind.LINK, src, t.dst, t.layer, t.nbytes, now, begin, done, len(t.keys)))
