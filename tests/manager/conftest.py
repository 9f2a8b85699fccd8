from __future__ import annotations

import time

import pytest
import torch

from tierkv.knobs import IOKnobs
from tierkv.keys import BlockKey
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import MemoryTier

BLOCK = 4096


def key(i: int) -> BlockKey:
    return BlockKey.of("test", i)


def block(i: int, nbytes: int = BLOCK) -> torch.Tensor:
    """Deterministic contents per block id."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class SlowTier(MemoryTier):
    """A memory tier whose reads and writes take ``delay`` seconds per block."""

    def __init__(self, name: str, medium: Medium, slots: int, delay: float) -> None:
        super().__init__(name, medium, torch.device("cpu"), BLOCK, slots * BLOCK)
        self.delay = delay

    def view(self, slot: int) -> torch.Tensor:
        time.sleep(self.delay)
        return super().view(slot)

    def buffers(self, slots):   # the NVMe tier reads into and writes from these
        time.sleep(self.delay * len(slots))
        return super().buffers(slots)

    def addresses(self, slots):   # host-to-host copies find blocks by their addresses
        time.sleep(self.delay * len(slots))
        return super().addresses(slots)


@pytest.fixture
def knobs() -> IOKnobs:
    return IOKnobs(copy_threads=2, inflight_bytes=64 * BLOCK)


def assert_quiescent(manager) -> None:
    """No slot reserved or pinned anywhere, and the directory agrees with the pools."""
    from tierkv.tiers.pool import SlotState
    for name, tier in manager.tiers.items():
        held = {e.copies[name] for e in manager.directory if name in e.copies}
        for slot in tier.pool.slots_in_use():
            assert tier.pool.state(slot) is SlotState.READY, (name, slot)
            assert tier.pool.pins(slot) == 0, (name, slot)
        assert held == set(tier.pool.slots_in_use()), name
        assert tier.pool.used <= tier.pool.capacity
