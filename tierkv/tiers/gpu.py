"""The compute device's arena: CUDA memory when present, else host memory under the same budget (which
may be a range of a ``HostSpace`` shared with other host tiers)."""
from __future__ import annotations

import torch

from tierkv.device import compute_device
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import HostSpace, MemoryTier


class GpuTier(MemoryTier):
    def __init__(self, block_bytes: int, budget: int, device: torch.device | None = None,
                 space: HostSpace | None = None) -> None:
        super().__init__("gpu", Medium.GPU, device or compute_device(), block_bytes, budget, space=space)
