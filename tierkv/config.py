"""Typed, frozen configuration.

Sizes are written like ``512MiB``, ``4GiB``, ``1.5GB`` or plain byte counts.
Each config validates itself in ``__post_init__``; an error names the field,
the value and what is allowed.

Process-wide I/O knobs (``TIERKV_*``) are `tierkv.knobs`; sizes are parsed by `tierkv.sizes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.sizes import parse_size
from tierkv.tiers.cxl_link import LinkSpec, link_spec
from tierkv.tiers.remote import check_url


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Budgets of the tiers. A budget of 0 disables that tier; ``nvme_dir=None`` disables NVMe."""

    block_bytes: int = 256 * 1024
    gpu: int = 0
    cpu: int = 1024**3
    nvme_dir: Path | None = None
    nvme_budget: int = 64 * 1024**3
    gpu_policy: str = "lru"
    cpu_policy: str = "lru"
    nvme_policy: str = "lru"
    # A simulated CXL pool between cpu and nvme (or instead of cpu: cpu=0). 0 disables it.
    cxl: int = 0
    cxl_preset: str = "cxl2-x8"             # a name in tierkv.tiers.cxl_link.LINK_PRESETS
    cxl_read_gbps: float | None = None      # overrides of the preset's figures (None: the preset's)
    cxl_write_gbps: float | None = None
    cxl_latency_ns: float | None = None
    cxl_devices: int | None = None
    cxl_policy: str = "lru"
    # A store below the tiers shared by processes and machines: redis:// or rediss:// (None: none).
    remote: str | None = None
    remote_ttl: int = 7 * 24 * 3600         # seconds a remote block lives after its last write or read

    def __post_init__(self) -> None:
        for name in ("block_bytes", "gpu", "cpu", "nvme_budget", "cxl"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        if self.block_bytes <= 0:
            raise ConfigError(f"block_bytes={self.block_bytes}: must be > 0")
        if self.block_bytes % 4096:
            raise ConfigError(f"block_bytes={self.block_bytes}: must be a multiple of 4096 (O_DIRECT alignment)")
        for name in ("gpu", "cpu", "cxl"):
            budget = getattr(self, name)
            if 0 < budget < self.block_bytes:
                raise ConfigError(f"{name}={budget}: a non-zero budget must hold at least one block "
                                  f"(block_bytes={self.block_bytes})")
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", store_dir(self.nvme_dir))
            if self.nvme_budget < self.block_bytes:
                raise ConfigError(f"nvme_budget={self.nvme_budget}: must hold at least one block "
                                  f"(block_bytes={self.block_bytes})")
        if self.gpu == 0 and self.cpu == 0 and self.cxl == 0:
            if self.nvme_dir is None:
                raise ConfigError("gpu=0, cpu=0, cxl=0 and nvme_dir=None: at least one tier must be enabled")
            raise ConfigError("gpu=0, cpu=0 and cxl=0: blocks are read from nvme into a memory tier; give gpu, "
                              "cpu or cxl a budget of at least one block")
        if self.remote is not None:
            check_url(self.remote)
        if self.remote_ttl <= 0:
            raise ConfigError(f"remote_ttl={self.remote_ttl}: must be > 0 seconds")
        if self.cxl:
            self.cxl_link()  # validates the preset and the overrides now, not when tiers are built

    def cxl_link(self) -> LinkSpec:
        """The cxl tier's link: ``cxl_preset`` with the ``cxl_*`` figures that are set."""
        return link_spec(self.cxl_preset, read_gbps=self.cxl_read_gbps, write_gbps=self.cxl_write_gbps,
                         latency_ns=self.cxl_latency_ns, devices=self.cxl_devices)


def store_dir(value: str | Path) -> Path:
    """``value`` as the NVMe store's directory; an empty string (``Path('')`` is the working directory,
    where a store would be made by mistake) is refused; ``~`` is the home directory."""
    if not str(value).strip():
        raise ConfigError("nvme_dir='': give the store's directory (leave it out: no NVMe store)")
    return Path(value).expanduser()
