"""The cxl tier: a simulated CXL memory pool -- host memory behind a link model.

Its bytes are real (an arena of slots in host memory, like the cpu tier);
what is simulated is the link in front of them (see `tierkv.tiers.cxl_link`).
Everything that moves bytes into or out of the pool books them on the link
and completes no earlier than the model says::

    manager transfer (cpu->cxl, cxl->gpu, cxl->nvme, ...)   handler books slots' bytes, copies, waits
    put of a new block into the pool                        the put handler, likewise
    gather / scatter on the tier itself                     book, copy, wait

Slots interleave over the link's devices (``device = slot % devices``), so
blocks on different devices stream in parallel and blocks on one device
queue behind each other.

``view(slot)`` is the raw arena, as for every arena tier: the handlers use
it after booking. A caller that reads a view directly bypasses the model,
which is why the tier manager never serves reads in place from this tier
(``reads_in_place = False``): it loads the blocks into a faster tier first.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from tierkv.tiers.base import Medium
from tierkv.tiers.cxl_link import HOST, CxlLink, Direction, LinkSpec, Ticket, link_spec
from tierkv.tiers.memory import MemoryTier


class CxlTier(MemoryTier):
    """Slots of ``block_bytes`` in a simulated pool of ``budget`` bytes, behind ``link``."""

    reads_in_place = False

    def __init__(self, block_bytes: int, budget: int, link: CxlLink | LinkSpec | str = "cxl2-x8",
                 name: str = "cxl") -> None:
        super().__init__(name, Medium.CXL, torch.device("cpu"), block_bytes, budget)
        if isinstance(link, str):
            link = link_spec(link)
        self.link = link if isinstance(link, CxlLink) else CxlLink(link)

    @property
    def backend(self) -> str:
        """What the run reports: a model of a pool, whose blocks really live in host memory."""
        spec = self.link.spec
        return (f"simulated CXL pool in host memory ({spec.read_gbps:g}/{spec.write_gbps:g} GB/s, "
                f"{spec.latency_ns:g} ns, {spec.devices} device{'s' if spec.devices > 1 else ''})")

    def device_of(self, slot: int) -> int:
        return slot % self.link.spec.devices

    def book(self, direction: Direction, slots: Sequence[int], *, peer: str = HOST,
             layer: int | None = None) -> Ticket:
        """Book the bytes of ``slots`` moving ``direction`` (read: out of the pool, to ``peer``)."""
        per_device = Counter(self.device_of(s) for s in slots)
        src, dst = (self.name, peer) if direction is Direction.READ else (peer, self.name)
        return self.link.book(direction, {d: n * self.block_bytes for d, n in per_device.items()},
                              src=src, dst=dst, layer=layer)

    def gather(self, slots: Sequence[int], out: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        ticket = self.book(Direction.READ, slots)
        super().gather(slots, out, rows)
        self.link.wait(ticket)

    def scatter(self, slots: Sequence[int], src: torch.Tensor) -> None:
        ticket = self.book(Direction.WRITE, slots)
        super().scatter(slots, src)
        self.link.wait(ticket)


def cxl_tier(block_bytes: int, budget: int, preset: str = "cxl2-x8", **overrides: float | int | None) -> CxlTier:
    """A cxl tier from a preset name and optional link fields (``read_gbps``, ``latency_ns``, ...)."""
    return CxlTier(block_bytes, budget, link_spec(preset, **overrides))
