"""What every tier is: a medium, a budget in fixed-size slots, and a pool.

Two kinds of tier move bytes differently:

* an *arena* tier (gpu, cpu, cxl) holds its blocks in memory and hands out a
  tensor view of a slot; copies between arenas are plain tensor copies;
* a *store* tier (nvme) holds blocks in files; it reads a slot into a host
  tensor and writes a slot from one, on its own I/O threads.

Tiers know no policy and no other tier. The manager pairs them through
transfer handlers registered per (source medium, destination medium).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from tierkv.tiers.pool import BlockPool


class Medium(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    CXL = "cxl"
    NVME = "nvme"


@runtime_checkable
class Tier(Protocol):
    name: str
    medium: Medium
    block_bytes: int
    pool: BlockPool

    @property
    def budget_bytes(self) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class ArenaTier(Tier, Protocol):
    device: torch.device

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes: a uint8 tensor of ``block_bytes``, on ``device``."""
        ...

    def buffers(self, slots: Sequence[int]) -> Sequence:
        """Each slot's bytes as a flat uint8 buffer (numpy on the host, a tensor on a device)."""
        ...
