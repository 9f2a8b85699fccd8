"""The tiers a ``TierConfig`` names, fastest first: gpu, cpu, the simulated CXL pool, the NVMe store;
what any set of tiers must be for a manager to run over it; and the eviction policies it runs them by."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies import make_policy
from tierkv.config import TierConfig
from tierkv.device import compute_device, has_cuda
from tierkv.knobs import IOKnobs
from tierkv.manager.array_lru import ArrayLRU
from tierkv.manager.directory import Directory
from tierkv.policy import EvictionPolicy
from tierkv.tiers.base import Medium, Tier
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.memory import HostSpace


def build_tiers(config: TierConfig, *, namespace: str = "default",
                knobs: IOKnobs | None = None) -> list[Tier]:
    """The tiers, fastest first. The gpu and cpu tiers that are plain host memory (no CUDA) share one
    ``HostSpace``: a read of blocks spread over both takes their rows in place, copying none whole."""
    knobs = knobs or IOKnobs.from_env()
    tiers: list[Tier] = []
    device = compute_device()
    in_space = {"gpu": bool(config.gpu) and device.type == "cpu", "cpu": bool(config.cpu) and not has_cuda()}
    space = HostSpace(config.block_bytes) if any(in_space.values()) else None
    if config.gpu:
        tiers.append(GpuTier(config.block_bytes, config.gpu, device, space=space if in_space["gpu"] else None))
    if config.cpu:
        tiers.append(CpuTier(config.block_bytes, config.cpu, space=space if in_space["cpu"] else None))
    if space is not None:
        space.rows()            # mapped now (committed only as written): budgets it cannot map fail here
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


def named_policies(config: TierConfig, tiers: Sequence[Tier]) -> dict[str, EvictionPolicy]:
    """The policy ``config`` names for each tier; a store's "lru" is left to `build_policies`."""
    names = {"gpu": config.gpu_policy, "cpu": config.cpu_policy, "cxl": config.cxl_policy, "nvme": config.nvme_policy}
    return {t.name: make_policy(names[t.name], capacity=t.pool.capacity) for t in tiers
            if not (t.medium is Medium.NVME and names[t.name] == "lru")}


def build_policies(tiers: Sequence[Tier], directory: Directory,
                   given: Mapping[str, EvictionPolicy] | None) -> dict[str, EvictionPolicy]:
    """``given``, and LRU for every other tier: a memory tier's in its own order (it holds few blocks
    and evicts on most loads), a store's in ``directory``'s arrays (the same victims, 4 bytes a block)."""
    return {t.name: ArrayLRU(directory, t.name) if t.medium is Medium.NVME
            else make_policy("lru", capacity=t.pool.capacity) for t in tiers} | dict(given or {})
