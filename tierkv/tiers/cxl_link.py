"""The CXL link model: load-to-use latency, bandwidth per direction, one queue per device and direction.

A simulated pool is host memory behind this model. Every byte that crosses
the link is *booked* on a channel, and the thread that moves it sleeps until
the modelled completion, so the caller sees what the link would charge::

    host ──write──▶ [dev 0 write queue] ──▶ pool DRAM      slots interleave over devices:
         ◀──read─── [dev 0 read queue ] ◀──                device = slot % devices
         ...         dev 1 .. devices-1

A request of ``n`` bytes on one channel (device, direction), booked at ``now``::

    begin = max(now, busy_until[channel])          queueing: begin - now
    busy_until[channel] = begin + n / bandwidth    the channel streams one request at a time
    done  = busy_until[channel] + latency          load-to-use latency, pipelined behind the bytes

so an idle link charges exactly ``n / bandwidth + latency`` and concurrent
requests on one channel serialize (first booked, first served). A request
spanning several devices completes when its slowest device does. The
latency does not hold the channel: a device keeps many requests in flight,
as CXL.mem does with its tags. The model never makes a copy faster than the
host can do it: the bytes are copied for real, then the thread sleeps only
for what is left of the modelled time.

Presets (``LINK_PRESETS``). Figures with a source are cited; the others are
assumptions, marked so:

=============  =======  =======  =========  =======  ===========================================
preset         read     write    latency    devices  basis
=============  =======  =======  =========  =======  ===========================================
cxl2-x8        28 GB/s  28 GB/s  250 ns     1        CXL 2.0 runs on the PCIe 5.0 PHY, 32 GT/s a
                                                     lane: x8 = 31.5 GB/s raw per direction
                                                     (CXL 2.0 spec); 28 = raw less ~10 % flit and
                                                     protocol overhead (assumption). Shipping x8
                                                     Type-3 expanders: Micron CZ120 "up to 36 GB/s"
                                                     (MLC, 2:1 read/write, both directions), Samsung
                                                     CMM-D 2.0 35-36 GB/s.
cxl2-x16       56 GB/s  56 GB/s  250 ns     1        x16 = 63 GB/s raw per direction (spec), same
                                                     overhead assumption; Samsung CMM-B (a pool box
                                                     on PCIe 5.0 x16) quotes 60 GB/s.
cxl2-x8x4      28 GB/s  28 GB/s  250 ns     4        four x8 expanders, slots interleaved.
cmm-b          60 GB/s  60 GB/s  596 ns     1        Samsung CMM-B rack pool: 60 GB/s, 596 ns
                                                     (Samsung, Memcon 2024). 60 GB/s is quoted as
                                                     one figure: used for each direction (assumption).
=============  =======  =======  =========  =======  ===========================================

Latency 250 ns (assumption) sits in the published range: Pond (Li et al.,
ASPLOS'23) measures +70-90 ns over local DRAM for a small direct-attached
pool (so ~170-230 ns load-to-use); real expanders measure 2-5x local DRAM
("Demystifying CXL Memory with Genuine CXL-Ready Systems and Devices",
Sun et al., MICRO'23; "Exploring and Evaluating Real-world CXL", 2024).
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tierkv.errors import ConfigError
from tierkv.events import Event, EventKind, EventRecorder

HOST = "host"   # the other end of a request that no tier names (a query, a selection)
_OVERSLEEP_S = 2e-3   # a sleep ending this late is the timer's slack, not a slow copy


class Direction(enum.Enum):
    READ = "read"     # pool -> host
    WRITE = "write"   # host -> pool


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One CXL attachment: per-direction bandwidth (1e9 bytes/s), load-to-use latency, devices."""

    read_gbps: float
    write_gbps: float
    latency_ns: float
    devices: int = 1

    def __post_init__(self) -> None:
        for name in ("read_gbps", "write_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"cxl {name}={value!r}: must be a bandwidth > 0 (GB/s, 1e9 bytes/s)")
        if isinstance(self.latency_ns, bool) or not isinstance(self.latency_ns, int | float) \
                or not self.latency_ns >= 0:
            raise ConfigError(f"cxl latency_ns={self.latency_ns!r}: must be >= 0 (nanoseconds)")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ConfigError(f"cxl devices={self.devices!r}: must be an integer >= 1")

    def gbps(self, direction: Direction) -> float:
        return self.read_gbps if direction is Direction.READ else self.write_gbps

    def seconds(self, nbytes: int, direction: Direction) -> float:
        """What an idle link charges for ``nbytes`` on one device: bytes / bandwidth + latency."""
        return nbytes / (self.gbps(direction) * 1e9) + self.latency_ns * 1e-9


LINK_PRESETS: Mapping[str, LinkSpec] = {
    "cxl2-x8": LinkSpec(28.0, 28.0, 250.0),
    "cxl2-x16": LinkSpec(56.0, 56.0, 250.0),
    "cxl2-x8x4": LinkSpec(28.0, 28.0, 250.0, devices=4),
    "cmm-b": LinkSpec(60.0, 60.0, 596.0),
}


def link_spec(preset: str, **overrides: float | int | None) -> LinkSpec:
    """A preset by name, with any of ``read_gbps``, ``write_gbps``, ``latency_ns``, ``devices`` replaced."""
    if preset not in LINK_PRESETS:
        raise ConfigError(f"cxl_preset={preset!r}: unknown; valid presets: {', '.join(LINK_PRESETS)}")
    unknown = sorted(set(overrides) - {"read_gbps", "write_gbps", "latency_ns", "devices"})
    if unknown:
        raise ConfigError(f"cxl link fields {unknown}: unknown; allowed: read_gbps, write_gbps, latency_ns, devices")
    return replace(LINK_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True, slots=True)
class Ticket:
    """One booked request: when it was booked, when its bytes began to stream, when it completes."""

    direction: Direction
    nbytes: int
    submit: float
    begin: float
    done: float
    src: str
    dst: str
    layer: int | None

    @property
    def queue_s(self) -> float:
        return self.begin - self.submit

    @property
    def link_s(self) -> float:
        return self.done - self.begin


@dataclass(slots=True)
class LinkStats:
    """What crossed the link, per direction: bytes, requests, modelled link and queue seconds."""

    nbytes: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    requests: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    link_s: float = 0.0
    queue_s: float = 0.0
    overrun_s: float = 0.0      # host copies that took longer than the model (beyond timer slack)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())


class CxlLink:
    """Books requests on per-(device, direction) channels; ``wait`` sleeps until a ticket completes.

    Thread-safe: tier handlers and the near-memory processor book from worker threads.
    ``recorder``, when set, receives a ``queue`` slice (if the request waited) and a ``link`` slice
    per request (see tierkv.events).
    """

    def __init__(self, spec: LinkSpec, recorder: EventRecorder | None = None) -> None:
        self.spec = spec
        self.recorder = recorder
        self.stats = LinkStats()
        self._busy_until: dict[tuple[int, Direction], float] = {}
        self._lock = threading.Lock()

    def book(self, direction: Direction, per_device: Mapping[int, int], *, src: str = HOST,
             dst: str = HOST, layer: int | None = None) -> Ticket:
        """Book ``per_device[d]`` bytes on each device ``d``; the ticket completes with the slowest."""
        bad = [d for d in per_device if not 0 <= d < self.spec.devices]
        if bad:
            raise ValueError(f"device={bad[0]}: this link has devices 0..{self.spec.devices - 1}")
        now = time.perf_counter()
        rate = self.spec.gbps(direction) * 1e9
        begin, done = now, now
        with self._lock:
            first = True
            for device, nbytes in per_device.items():
                start = max(now, self._busy_until.get((device, direction), 0.0))
                self._busy_until[(device, direction)] = start + nbytes / rate
                begin = start if first else min(begin, start)
                done = max(done, start + nbytes / rate + self.spec.latency_ns * 1e-9)
                first = False
            ticket = Ticket(direction, sum(per_device.values()), now, begin, done, src, dst, layer)
            self._account(ticket)
        return ticket

    def book_bytes(self, direction: Direction, nbytes: int, **where: object) -> Ticket:
        """``nbytes`` striped evenly over every device (data not tied to slots: queries, landmarks)."""
        share, rest = divmod(nbytes, self.spec.devices)
        per_device = {d: share + (d < rest) for d in range(self.spec.devices) if share + (d < rest)}
        return self.book(direction, per_device or {0: 0}, **where)  # type: ignore[arg-type]

    def wait(self, ticket: Ticket) -> float:
        """Sleep until ``ticket`` completes; records its slices; returns when it really completed.

        The slices are the model's; a copy that outran it (a host slower than the modelled link)
        shows in the transfer's own event and in ``stats.overrun_s``.
        """
        sleep_until(ticket.done)
        finished = time.perf_counter()
        with self._lock:
            self.stats.overrun_s += max(0.0, finished - ticket.done - _OVERSLEEP_S)
        if self.recorder is not None:
            self._record(ticket)
        return finished

    def transfer(self, direction: Direction, nbytes: int, **where: object) -> Ticket:
        """Book ``nbytes`` and wait for them (a request nobody copies bytes beside)."""
        ticket = self.book_bytes(direction, nbytes, **where)
        self.wait(ticket)
        return ticket

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = LinkStats()

    # -- internals -------------------------------------------------------------
    def _account(self, ticket: Ticket) -> None:
        self.stats.nbytes[ticket.direction] += ticket.nbytes
        self.stats.requests[ticket.direction] += 1
        self.stats.link_s += ticket.link_s
        self.stats.queue_s += ticket.queue_s

    def _record(self, t: Ticket) -> None:
        assert self.recorder is not None
        if t.queue_s > 0:
            self.recorder.record(Event(EventKind.QUEUE, t.src, t.dst, t.layer, t.nbytes, t.submit, t.submit, t.begin))
        self.recorder.record(Event(EventKind.LINK, t.src, t.dst, t.layer, t.nbytes, t.submit, t.begin, t.done))


def sleep_until(deadline: float) -> None:
    """Sleep to ``deadline`` (perf_counter); ``time.sleep`` may wake early, so loop."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
