"""The tiers a ``TierConfig`` names, fastest first: gpu, cpu, the simulated CXL pool, the NVMe store."""
from __future__ import annotations

from tierkv.config import TierConfig
from tierkv.knobs import IOKnobs
from tierkv.tiers.base import Tier
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier


def build_tiers(config: TierConfig, *, namespace: str = "default",
                knobs: IOKnobs | None = None) -> list[Tier]:
    knobs = knobs or IOKnobs.from_env()
    tiers: list[Tier] = []
    if config.gpu:
        tiers.append(GpuTier(config.block_bytes, config.gpu))
    if config.cpu:
        tiers.append(CpuTier(config.block_bytes, config.cpu))
    if config.cxl:
        from tierkv.tiers.cxl import CxlTier
        tiers.append(CxlTier(config.block_bytes, config.cxl, config.cxl_link()))
    if config.nvme_dir is not None:
        from tierkv.tiers.nvme import NvmeTier
        tiers.append(NvmeTier(config.nvme_dir, config.block_bytes, config.nvme_budget,
                              namespace=namespace, backend=knobs.nvme_backend,
                              io_threads=knobs.io_threads))
    return tiers
