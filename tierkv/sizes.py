"""Sizes written like ``512MiB``, ``4GiB``, ``1.5GB`` or plain byte counts, and back."""
from __future__ import annotations

import re

from tierkv.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


MAX_SIZE = 2**60   # 1 EiB: past it a size is a typo, and memory maps and file offsets overflow


def parse_size(value: str | int, field_name: str = "size") -> int:
    """Bytes from ``4GiB`` / ``512MiB`` / ``1.5GB`` / ``4096`` (an int passes through)."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}={value!r}: expected a size like 512MiB, 4GiB or a byte count")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{field_name}={value!r}: expected a size like 512MiB, 4GiB, 1.5GB or a byte count "
                f"(units: {', '.join(u for u in _UNITS if u)})"
            )
        size = float(match.group(1)) * _UNITS[unit]
        if _UNITS[unit] == 1 and not size.is_integer():
            raise ConfigError(f"{field_name}={value!r}: a byte count is a whole number (or give a unit, "
                              f"such as 1.5MiB)")
    if size < 0:
        raise ConfigError(f"{field_name}={value}: a size must be >= 0")
    if size > MAX_SIZE:
        raise ConfigError(f"{field_name}={value!r}: more than any machine addresses (at most 1 EiB)")
    return int(size)


def format_size(n: float) -> str:
    """``format_size(3 * 2**20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
