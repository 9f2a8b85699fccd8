"""A transfer is a value: which blocks move from which tier to which, and why.

Handlers that move the bytes are registered per (source medium, destination
medium). A handler runs on a worker thread, never on the event loop, and
returns the keys whose source bytes failed verification (the NVMe store's
checksums), or an `InFlight` while its copies still run on a device stream;
any exception fails the whole transfer. A pair with a cxl end
is wrapped by `through_link`, so its bytes cost what the pool's link model
charges. Puts (a caller's new block) have one handler per destination medium.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierkv.device import new_event, new_stream, on_stream, staging_pool
from tierkv.keys import BlockKey
from tierkv.tiers.base import Medium
from tierkv.tiers.cxl_link import Direction
from tierkv.tiers.nvme_striped import BACKGROUND, LAST, URGENT


class Priority(enum.IntEnum):
    NOW = 0        # a caller is waiting for it
    PREFETCH = 1   # a caller will probably need it soon
    WRITEBACK = 2  # durability; nobody waits


class Kind(enum.Enum):
    PUT = "put"
    LOAD = "load"
    PREFETCH = "prefetch"
    DEMOTE = "demote"
    WRITEBACK = "writeback"


@dataclass(frozen=True, slots=True)
class Transfer:
    kind: Kind
    src: str
    dst: str
    keys: tuple[BlockKey, ...]
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    nbytes: int
    layer: int | None = None
    cold: bool = False     # a guessed prefetch: its blocks enter ``dst`` cold (tierkv.policy.AdmitsCold)


@dataclass(frozen=True, slots=True)
class InFlight:
    """What a handler returns while its copies still run on a device stream: the transfer is over
    once ``event.query()`` says so (the runner polls it; no thread blocks in ``synchronize``)."""
    event: object
    failed: list[BlockKey]


Handler = Callable[[Transfer, object, object], "list[BlockKey] | InFlight"]
_HANDLERS: dict[tuple[Medium, Medium], Handler] = {}
MEMORY = (Medium.GPU, Medium.CPU, Medium.CXL)


def register_handler(src: Medium, dst: Medium) -> Callable[[Handler], Handler]:
    def decorate(fn: Handler) -> Handler:
        _HANDLERS[(src, dst)] = fn
        return fn
    return decorate


def handler_for(src: Medium, dst: Medium) -> Handler:
    try:
        return _HANDLERS[(src, dst)]
    except KeyError:
        pairs = ", ".join(f"{a.value}->{b.value}" for a, b in sorted(_HANDLERS, key=str))
        raise LookupError(f"no transfer handler for {src.value}->{dst.value}; registered: {pairs}") from None


class _Streams:
    """One stream per direction, created on first use (null streams on CPU)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, str], object] = {}

    def get(self, src: torch.device, dst: torch.device) -> object:
        device = dst if dst.type == "cuda" else src
        key = (str(src), str(dst))
        if key not in self._streams:
            self._streams[key] = new_stream(device)
        return self._streams[key]


STREAMS = _Streams()


def copy_memory(t: Transfer, src, dst) -> list[BlockKey] | InFlight:
    if src.device.type == "cpu" and dst.device.type == "cpu":
        src.copy_slots(t.src_slots, dst, t.dst_slots)
        return []
    stream = STREAMS.get(src.device, dst.device)
    event = new_event(dst.device if dst.device.type == "cuda" else src.device)
    with on_stream(stream):
        for s, d in zip(t.src_slots, t.dst_slots):
            dst.view(d).copy_(src.view(s), non_blocking=True)
        event.record()
    return InFlight(event, [])   # one event per transfer, polled until the copies are done


# A transfer's place in the NVMe store's I/O queue: a read a caller waits for overtakes a prefetch
# or a write-back already under way (tierkv.tiers.nvme_striped.JobQueue).
_IO_PRIORITY = {Kind.PREFETCH: BACKGROUND, Kind.WRITEBACK: LAST}


def write_store(t: Transfer, src, store) -> list[BlockKey]:
    views = src.buffers(t.src_slots)
    priority, aligned = _IO_PRIORITY.get(t.kind, URGENT), getattr(src, "aligned_slots", False)
    if src.device.type != "cuda" or store.backend == "kvikio":
        store.write(list(zip(t.keys, t.dst_slots, views)), priority=priority, aligned=aligned)
        return []
    with staging_pool(store.block_bytes).take(len(views)) as bounce:   # through reused pinned buffers
        for host, view in zip(bounce, views):
            host.copy_(view)
        store.write(list(zip(t.keys, t.dst_slots, bounce)), priority=priority, aligned=True)
    return []


def read_store(t: Transfer, store, dst) -> list[BlockKey]:
    views = dst.buffers(t.dst_slots)
    priority = _IO_PRIORITY.get(t.kind, URGENT)
    if dst.device.type == "cpu" and getattr(dst, "aligned_slots", False):   # host rows: their addresses at once
        return store.read(list(zip(t.keys, t.src_slots, views)), priority=priority, aligned=True,
                          addresses=dst.addresses(t.dst_slots))
    if dst.device.type != "cuda" or store.backend == "kvikio":
        return store.read(list(zip(t.keys, t.src_slots, views)), priority=priority,
                          aligned=getattr(dst, "aligned_slots", False))
    with staging_pool(store.block_bytes).take(len(views)) as bounce:
        failed = store.read(list(zip(t.keys, t.src_slots, bounce)), priority=priority, aligned=True)
        for host, view in zip(bounce, views):
            view.copy_(host)
    return failed


def through_link(handler: Handler) -> Handler:
    """``handler`` for a pair with a cxl end: book the bytes on the pool's link, move them, wait.

    A read books on the source pool, a write on the destination pool (cxl->cxl: both);
    the transfer completes when the copy is done and the link model says it would be.
    """
    def charged(t: Transfer, src, dst) -> list[BlockKey]:
        tickets = [_book(src, Direction.READ, t.src_slots, t.dst, t.layer),
                   _book(dst, Direction.WRITE, t.dst_slots, t.src, t.layer)]
        failed = handler(t, src, dst)
        for booked in tickets:
            if booked is not None:
                booked[0].wait(booked[1])
        return failed
    return charged


def _book(tier, direction: Direction, slots: tuple[int, ...], peer: str, layer: int | None) -> tuple | None:
    """``(link, ticket)`` when ``tier`` is a pool with a link model; None for any other tier
    (a tier of medium cxl without a link, e.g. the replay's, is priced elsewhere)."""
    if tier.medium is not Medium.CXL or getattr(tier, "link", None) is None:
        return None
    return tier.link, tier.book(direction, slots, peer=peer or "new", layer=layer)


for _a in MEMORY:
    register_handler(_a, Medium.NVME)(write_store)
    register_handler(Medium.NVME, _a)(read_store)
    for _b in MEMORY:
        register_handler(_a, _b)(copy_memory)
for _pair, _handler in list(_HANDLERS.items()):
    if Medium.CXL in _pair:
        _HANDLERS[_pair] = through_link(_handler)


# -- puts: a caller's new blocks into a tier ------------------------------------------
PutHandler = Callable[[Transfer, torch.Tensor, object], list[BlockKey]]   # rows [n, block_bytes] into dst_slots
_PUTS: dict[Medium, PutHandler] = {}


def put_handler_for(medium: Medium) -> PutHandler:
    return _PUTS[medium]


def put_memory(t: Transfer, rows: torch.Tensor, tier) -> list[BlockKey]:
    tier.scatter(t.dst_slots, rows)
    return []


def put_store(t: Transfer, rows: torch.Tensor, store) -> list[BlockKey]:
    store.write(list(zip(t.keys, t.dst_slots, rows.cpu())))
    return []


def put_pool(t: Transfer, rows: torch.Tensor, pool) -> list[BlockKey]:
    booked = _book(pool, Direction.WRITE, t.dst_slots, "new", t.layer)
    for slot, row in zip(t.dst_slots, rows):   # views: the link is booked above, with the layer
        pool.view(slot).copy_(row)
    if booked is not None:
        booked[0].wait(booked[1])
    return []


_PUTS.update({Medium.GPU: put_memory, Medium.CPU: put_memory, Medium.CXL: put_pool, Medium.NVME: put_store})
