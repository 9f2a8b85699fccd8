"""Typed, frozen configuration.

Sizes are written like ``512MiB``, ``4GiB``, ``1.5GB`` or plain byte counts.
Each config validates itself in ``__post_init__``; an error names the field,
the value and what is allowed.

Process-wide I/O knobs (and only those) come from the environment:

=========================  ========  ===============================================
variable                   default   meaning
=========================  ========  ===============================================
TIERKV_IO_THREADS          4         worker threads of the NVMe tier (O_DIRECT/buffered)
TIERKV_NVME_BACKEND        auto      force a backend: auto, kvikio, odirect, buffered
TIERKV_COPY_THREADS        2         worker threads for host/device copies
TIERKV_INFLIGHT_BYTES      256MiB    bytes the manager keeps in flight at most
TIERKV_CACHE_DIR           ~/.cache/tierkv  converted models (GGUF -> safetensors) under models/
=========================  ========  ===============================================
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from tierkv.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, field_name: str = "size") -> int:
    """Bytes from ``4GiB`` / ``512MiB`` / ``1.5GB`` / ``4096`` (an int passes through)."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}={value!r}: expected a size like 512MiB, 4GiB or a byte count")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field_name}={value}: a size must be >= 0")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{field_name}={value!r}: expected a size like 512MiB, 4GiB, 1.5GB or a byte count "
            f"(units: {', '.join(u for u in _UNITS if u)})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """``format_size(3 * 2**20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")


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

    def __post_init__(self) -> None:
        for name in ("block_bytes", "gpu", "cpu", "nvme_budget", "cxl"):
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        _positive("block_bytes", self.block_bytes)
        if self.block_bytes % 4096:
            raise ConfigError(f"block_bytes={self.block_bytes}: must be a multiple of 4096 (O_DIRECT alignment)")
        for name in ("gpu", "cpu", "cxl"):
            budget = getattr(self, name)
            if 0 < budget < self.block_bytes:
                raise ConfigError(f"{name}={budget}: a non-zero budget must hold at least one block "
                                  f"(block_bytes={self.block_bytes})")
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", Path(self.nvme_dir))
            if self.nvme_budget < self.block_bytes:
                raise ConfigError(f"nvme_budget={self.nvme_budget}: must hold at least one block "
                                  f"(block_bytes={self.block_bytes})")
        if self.gpu == 0 and self.cpu == 0 and self.cxl == 0 and self.nvme_dir is None:
            raise ConfigError("gpu=0, cpu=0, cxl=0 and nvme_dir=None: at least one tier must be enabled")
        if self.cxl:
            self.cxl_link()  # validates the preset and the overrides now, not when tiers are built

    def cxl_link(self):  # -> tierkv.tiers.cxl_link.LinkSpec (imported here: config sits below tiers)
        """The cxl tier's link: ``cxl_preset`` with the ``cxl_*`` figures that are set."""
        from tierkv.tiers.cxl_link import link_spec
        return link_spec(self.cxl_preset, read_gbps=self.cxl_read_gbps, write_gbps=self.cxl_write_gbps,
                         latency_ns=self.cxl_latency_ns, devices=self.cxl_devices)


@dataclass(frozen=True, slots=True)
class IOKnobs:
    """Process-wide I/O knobs, read from ``TIERKV_*`` (see the table above)."""

    io_threads: int = 4
    nvme_backend: str = "auto"
    copy_threads: int = 2
    inflight_bytes: int = 256 * 1024**2
    backends: tuple[str, ...] = field(default=("auto", "kvikio", "odirect", "buffered"), repr=False)

    def __post_init__(self) -> None:
        _positive("TIERKV_IO_THREADS", self.io_threads)
        _positive("TIERKV_COPY_THREADS", self.copy_threads)
        _positive("TIERKV_INFLIGHT_BYTES", self.inflight_bytes)
        if self.nvme_backend not in self.backends:
            raise ConfigError(f"TIERKV_NVME_BACKEND={self.nvme_backend!r}: allowed: {', '.join(self.backends)}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> IOKnobs:
        env = os.environ if env is None else env
        defaults = {f.name: f.default for f in fields(cls)}

        def integer(name: str, default: int) -> int:
            raw = env.get(name)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: expected an integer") from None

        return cls(
            io_threads=integer("TIERKV_IO_THREADS", defaults["io_threads"]),
            nvme_backend=env.get("TIERKV_NVME_BACKEND", defaults["nvme_backend"]),
            copy_threads=integer("TIERKV_COPY_THREADS", defaults["copy_threads"]),
            inflight_bytes=parse_size(env.get("TIERKV_INFLIGHT_BYTES", defaults["inflight_bytes"]),
                                      "TIERKV_INFLIGHT_BYTES"),
        )
