"""The host arena: pinned memory where CUDA exists (``pin_memory=True`` raises without it); plain host
memory elsewhere, which may be a range of a ``HostSpace`` shared with other host tiers."""
from __future__ import annotations

import torch

from tierkv.device import has_cuda
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import HostSpace, MemoryTier


class CpuTier(MemoryTier):
    def __init__(self, block_bytes: int, budget: int, space: HostSpace | None = None) -> None:
        super().__init__("cpu", Medium.CPU, torch.device("cpu"), block_bytes, budget, pinned=has_cuda(), space=space)
