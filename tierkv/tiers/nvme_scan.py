"""A store read whole without joining it: for `tierkv store verify` of a store this process may
not write to (a read-only file system, another user's). Joining writes (an owner file, the
claims, a torn journal cut), so here nothing is opened for writing and no lock is taken: the
journal is replayed as an opener would and every block it names is read and checked."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.tiers.journal import replay
from tierkv.tiers.nvme_striped import checksum


def scan_read_only(directory: Path) -> tuple[list[BlockKey], list[BlockKey]]:
    """Read every block of the store in ``directory`` and check it against its checksum without joining
    the store (nothing is opened for writing, no lock taken): for a store this process may not write
    to. The keys of its blocks, and of those that failed. A process writing to the store meanwhile
    may make a block it rewrites look damaged."""
    try:
        block_bytes = int(json.loads((directory / "store.json").read_text())["block_bytes"])
        raw = (directory / "index.log").read_bytes() if (directory / "index.log").exists() else b""
        if not (directory / "slots.dat").exists():     # a store that never held a block
            return [], []
        fd = os.open(directory / "slots.dat", os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{directory}: not a readable tierkv NVMe store ({exc})") from None
    try:
        state, _ = replay(raw, slots=os.fstat(fd).st_size // block_bytes)
        keys, slots, sums = state.index.records()
        damaged = [key for key, slot, expected in zip(keys, slots, sums)
                   if checksum(os.pread(fd, block_bytes, slot * block_bytes)) != expected]
    finally:
        os.close(fd)
    return keys, damaged
