"""The tiers a ``TierConfig`` names, fastest first: gpu, cpu, the simulated CXL pool, the NVMe store;
and what any set of tiers must be for a manager to run over it."""
from __future__ import annotations

from collections.abc import Sequence

from tierkv.config import TierConfig
from tierkv.knobs import IOKnobs
from tierkv.tiers.base import Medium, Tier
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


def check_tiers(tiers: Sequence[Tier]) -> int:
    """The block size ``tiers`` share; a ValueError unless there is one and a memory tier to read into."""
    if not tiers:
        raise ValueError("a tier manager needs at least one tier")
    sizes = {t.block_bytes for t in tiers}
    if len(sizes) != 1:
        raise ValueError(f"all tiers must share one block size, got {sorted(sizes)}")
    if all(t.medium is Medium.NVME for t in tiers):
        raise ValueError("a tier manager needs a memory tier (gpu or cpu) to read blocks into")
    return sizes.pop()
