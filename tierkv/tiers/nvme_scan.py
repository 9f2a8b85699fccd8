"""A store read whole without joining it: what `tierkv store verify` reports. Joining writes (an
owner file, the claims, a torn journal cut, dropped entries journaled), so here nothing is opened for
writing and no lock is taken: the journal is replayed as an opener would and every block it names
is read and checked. What the replay itself finds is reported too: records damaged in the middle
of the journal, and blocks whose slots lie past the end of the data file (it was cut short), which
an opener drops without a word beyond its log."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.tiers.journal import Replay, replay_store
from tierkv.tiers.nvme_manifest import read_manifest
from tierkv.tiers.nvme_striped import checksum


@dataclass(slots=True)
class Scan:
    keys: list[BlockKey] = field(default_factory=list)       # the blocks the journal names, readable or not
    damaged: list[BlockKey] = field(default_factory=list)    # of those, failing their checksum
    lost: list[BlockKey] = field(default_factory=list)       # named in slots past the end of slots.dat
    bad_records: int = 0          # journal records damaged in the middle (each a block put or dropped)
    torn_bytes: int = 0           # journal records cut short at the end: writes a crash cut (not damage)
    no_journal: bool = False      # index.log is missing beside a slots.dat that held blocks: they are lost
    no_data: bool = False         # slots.dat is missing where the journal names blocks: they are lost


def journal_state(directory: Path) -> tuple[Replay, int]:
    """The store's journal replayed against its data file's size, and its block size, reading only."""
    block_bytes = read_manifest(directory)["block_bytes"]
    try:
        return replay_store(directory, block_bytes), block_bytes
    except OSError as exc:
        raise ConfigError(f"NVMe store {directory}: cannot read its files ({exc.strerror or exc})") from None


def scan_journal(directory: Path) -> Scan:
    """What the store's journal says, reading no block: what is lost, what records are damaged."""
    return _journal_scan(journal_state(directory)[0], directory)


def _journal_scan(state: Replay, directory: Path) -> Scan:
    journal, data = directory / "index.log", directory / "slots.dat"
    return Scan(lost=[key for key, _ in state.lost], bad_records=state.damaged, torn_bytes=state.cut_bytes,
                no_journal=not journal.exists() and data.exists() and data.stat().st_size > 0,
                no_data=bool(state.lost) and not data.exists())


def scan_read_only(directory: Path) -> Scan:
    """Read every block of the store in ``directory`` and check it against its checksum without joining
    the store (nothing is opened for writing, no lock taken). A block that fails is read again after a
    second replay of the journal, so that one a process rewrote meanwhile (its slot named anew, or no
    more) is not reported."""
    state, block_bytes = journal_state(directory)
    scan = _journal_scan(state, directory)
    if not (directory / "slots.dat").exists():     # a store that never held a block
        return scan
    keys, slots, sums = state.index.records()
    scan.keys = list(keys)
    with open(directory / "slots.dat", "rb", buffering=0) as f:
        fd = f.fileno()
        failed = [(key, slot, expected) for key, slot, expected in zip(keys, slots, sums)
                  if checksum(os.pread(fd, block_bytes, slot * block_bytes)) != expected]
        if failed:
            now = journal_state(directory)[0].index
            named = {key: (entry.slot, entry.checksum) for key, _, _ in failed if (entry := now.get(key)) is not None}
            scan.damaged = [key for key, slot, expected in failed if named.get(key) == (slot, expected)
                            and checksum(os.pread(fd, block_bytes, slot * block_bytes)) != expected]
    return scan
