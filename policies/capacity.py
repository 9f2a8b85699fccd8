"""The size, in blocks, that ARC and S3-FIFO divide into queues and ghost lists.

The manager decides when to evict, so a policy never sees the tier fill up.
Given no size, a policy takes the most keys it has ever held at once: the
manager evicts only when the tier is full, so that peak is the tier's size.
"""
from __future__ import annotations

from dataclasses import dataclass

from tierkv.errors import ConfigError


def validate_capacity(value: int | None) -> None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return
    raise ConfigError(
        f"capacity={value!r}: expected a positive number of blocks, "
        f"or None to learn it from the most keys ever resident"
    )


@dataclass(slots=True)
class Capacity:
    configured: int | None = None
    peak: int = 0

    def __post_init__(self) -> None:
        validate_capacity(self.configured)

    def observe(self, resident: int) -> None:
        self.peak = max(self.peak, resident)

    @property
    def blocks(self) -> int:
        return self.configured if self.configured is not None else max(1, self.peak)
