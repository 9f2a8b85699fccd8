"""The host arena: pinned memory where CUDA exists (``pin_memory=True`` raises without it)."""
from __future__ import annotations

import torch

from tierkv.device import has_cuda
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import MemoryTier


class CpuTier(MemoryTier):
    def __init__(self, block_bytes: int, budget: int) -> None:
        super().__init__("cpu", Medium.CPU, torch.device("cpu"), block_bytes, budget, pinned=has_cuda())
