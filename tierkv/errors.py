"""Every error tierkv raises on purpose derives from `TierKVError`.

Errors about data (`BlockMissing`, `BlockCorrupt`) tell the caller to
recompute the block; tierkv never serves bytes it cannot vouch for.
"""
from __future__ import annotations


class TierKVError(Exception):
    """Base class of tierkv's own errors."""


class ConfigError(TierKVError, ValueError):
    """A configuration value is invalid; the message names field, value and what is allowed."""


class BudgetExceeded(TierKVError):
    """A tier has no room left and nothing in it may be evicted."""


class BlockMissing(TierKVError, KeyError):
    """The block is not stored anywhere (never written, dropped, or lost in a crash); ``keys``
    names the blocks, where the raiser knows them (a repair computes exactly those again)."""

    def __init__(self, message: str = "block missing", keys: tuple = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "block missing"


class BlockCorrupt(BlockMissing):
    """The block's bytes failed their checksum; it was dropped and must be recomputed."""


class PassBroken(BlockMissing):
    """A pass met a missing block after it had changed what it cannot take back (a sparse pass that
    sealed pages in its first layers): the sequence cannot go on; a new request can."""


class DiskFullError(TierKVError, OSError):
    """The NVMe tier's file system has no space left for a block."""


class StoreWriteError(TierKVError, OSError):
    """A file of the store could not be written (a full disk is `DiskFullError`); nothing half-written is
    left under its name."""


class StoreReadError(TierKVError, OSError):
    """The device answered a read of a stored block with an error (EIO: perhaps a passing fault): the
    read fails, and the store keeps the block, to be read again (a checksum that fails is not this:
    that block is dropped, `BlockCorrupt`)."""


class StoreLocked(TierKVError):
    """Another process holds the NVMe store exclusively (a tierkv that cannot share stores)."""


class StoreUnusable(ConfigError):
    """The NVMe store's directory cannot be used as it is (permissions, no flock, a removed owner
    file); the message says what to change."""


class ManagerClosed(TierKVError, RuntimeError):
    """The tier manager was closed (or never started)."""
