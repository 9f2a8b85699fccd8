"""The NVMe tier: a persistent, crash-safe, content-addressed block store that processes share.

A store is one directory (0700; every file 0600)::

    DIR/
      store.json   manifest: {"format": "tierkv-nvme", "version": 1, "block_bytes",
                   "namespace", "created", "check": xxh3 of the first four}; opening with
                   another block_bytes or namespace is a ConfigError, and so is one
                   damaged, unless the blocks vouch for the opener's settings: then it
                   is rebuilt (tierkv.tiers.nvme_share.check_manifest)
      slots.dat    slot i at offset i * block_bytes; grown with fallocate (doubling, at
                   least 64 MiB a step, exactly what is needed when that does not fit,
                   never past the budget), by one process at a time
      index.log    journal of 48-byte PUT/DROP_AT records (see tierkv.tiers.journal)
      lock, claims, owners/
                   who has the store open and which slots each process owns
                   (see tierkv.tiers.nvme_share)

    slots.dat  |  slot 0  |  slot 1  |  slot 2  | ... |  slot n-1  |   n = budget // block_bytes
               0          B          2B         3B               (n)B  B = block_bytes
    index.log  | PUT k7 @0 c | PUT k3 @2 c | DROP_AT k7 @0 | PUT k9 @0 c | ...   (c = xxh3_64 of the bytes)

Several processes may have a store open at once: each reads every block, and
writes only into slots of the extents it claimed (tierkv.tiers.nvme_share), so
writes never meet. The budget caps the store as a whole: each process claims
extents as it needs them, up to an equal share among the processes that have
the store open, and keeps them until it closes (see tierkv.tiers.nvme_share). Write order makes a block visible only after its bytes are
written: data to ``slots.dat`` first (the I/O workers write while the calling
thread takes the checksums and encodes the records, see
tierkv.tiers.nvme_striped), then one batched append of PUT records at the end
of ``index.log`` once every byte is written, then this process's index. Other
processes see the block when they next `refresh` (a cheap look at the journal's
tail, see tierkv.tiers.nvme_view). A crash at any point leaves the journal a
valid prefix and every visible entry either holds the right bytes or fails its
checksum on read; a slot dropped and rewritten by its owner while another
process reads it fails that read too: nothing wrong is ever served. Nothing is
fsync'd until `NvmeTier.flush` (or close): a killed process loses nothing it
wrote, a power loss may lose the newest blocks but never serves them wrong.

Open replays the journal and marks every visible slot READY in `pool` (a
`SharedPool`, see tierkv.tiers.nvme_pool). An opener alone with the store also
drops entries past the budget or past the end of ``slots.dat`` (journaling a
DROP_AT for each), cuts a torn tail and compacts the journal when it is mostly
garbage; beside other processes, it hides such entries here only. The pool is
the manager's: `write` expects RESERVED slots of this process's extents and
changes no state; `drop` leaves the slot for the caller to release; `refresh`
adds READY records for blocks other processes wrote, so it runs on the pool's
thread too.

A `write` batch is all or nothing: on any error (ENOSPC becomes DiskFullError,
naming the directory and the bytes needed) none of its blocks becomes visible.
``backend="auto"`` defers to ``TIERKV_NVME_BACKEND`` and otherwise takes the
first of kvikio, odirect, buffered that passes a real probe in the directory
(tierkv.tiers.nvme_io); an explicit backend that fails its probe is a ConfigError.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Sequence
from itertools import compress
from operator import itemgetter
from pathlib import Path

import numpy as np
import torch

from tierkv.knobs import IOKnobs

from tierkv.failpoints import failpoint
from tierkv.errors import ConfigError, StoreReadError, StoreUnusable
from tierkv.keys import BlockKey
from tierkv.sizes import format_size
from tierkv.tiers.base import Medium
from tierkv.tiers.journal import Journal, Op, Record, encode_puts
from tierkv.tiers.nvme_io import (BACKENDS, DISK_FULL, block_buffer, choose_backend, disk_full, disk_full_raised,
                                  misaligned_of, store_errors_named)
from tierkv.tiers.nvme_pool import SharedPool
from tierkv.tiers.nvme_manifest import read_manifest
from tierkv.tiers.nvme_share import Membership, closed_here, opened_here
from tierkv.tiers.nvme_striped import UNREADABLE, URGENT, StripedIO
from tierkv.tiers.nvme_view import Changes, SharedView

log = logging.getLogger(__name__)

GROW_MIN = 64 * 1024**2
COMPACT_MIN_GARBAGE = 4096  # compact when garbage records exceed this and the live ones


class NvmeTier:
    """Blocks of ``block_bytes`` in ``directory``, at most ``budget_bytes // block_bytes`` of them."""

    name: str = "nvme"
    medium = Medium.NVME

    def __init__(self, directory: Path, block_bytes: int, budget_bytes: int, *, namespace: str = "default",
                 backend: str = "auto", io_threads: int = 4) -> None:
        _validate(block_bytes, budget_bytes, io_threads)
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        self.namespace = namespace
        self._capacity = budget_bytes // block_bytes
        self._lock = threading.RLock()   # (re-entered: a claim under it reads the journal's news)
        self._closed = True
        with store_errors_named(self.directory):
            self._share = Membership(self.directory)
            try:
                with self._share.claims.locked():  # the gate: one opener at a time
                    self._open(backend, io_threads)
            except BaseException:
                self._release_files()
                raise
        self._closed = False
        self._forked_from: int | None = None
        opened_here(self)

    @classmethod
    def existing(cls, directory: Path, **kw: object) -> NvmeTier:
        """The store in ``directory`` opened as its manifest describes it, with room for every slot its
        file holds (nothing is dropped for the budget): for tools that look at a store as it is."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        block_bytes, namespace = manifest["block_bytes"], str(manifest["namespace"])
        data = directory / "slots.dat"
        size = data.stat().st_size if data.exists() else 0
        return cls(directory, block_bytes, max(size, block_bytes), namespace=namespace, **kw)

    def _open(self, backend: str, io_threads: int) -> None:
        self._share.join(self._capacity, self.block_bytes, self.namespace)
        knobs = IOKnobs.from_env()
        if backend == "auto":  # TIERKV_NVME_BACKEND overrides only the automatic choice
            backend = knobs.nvme_backend
        self.backend = choose_backend(backend, self.directory, self.block_bytes)
        self._file = BACKENDS[self.backend](self.directory / "slots.dat")
        self._data_size = os.fstat(self._file.fd).st_size
        whole_slots = min(self._capacity, self._data_size // self.block_bytes)
        self._journal = Journal(self.directory / "index.log", repair=self._share.alone, slots=whole_slots)
        self._index = self._journal.state.index
        self._io = StripedIO(self._file, self.block_bytes, io_threads, native_reads=knobs.nvme_aio)
        self.pool = SharedPool(self._capacity, self._share.claims, self._share.owner.id)
        self._recover()
        self._view = SharedView(self._index, self.pool, () if self._share.alone else self._journal.state.extra,
                                drop_at=self._drop_at)
        self.pool.adopted = self._adopted
        self._news = Changes()          # what the journal said as an extent was taken: for the next refresh
        self.pool.catch_up = self._catch_up
        self.opened_alone = self._share.alone   # (this opener repaired the store: lost entries dropped)
        self._share.settle()

    # -- queries -----------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._capacity * self.block_bytes

    def lookup(self, key: BlockKey) -> int | None:
        with self._lock:   # the index's arrays change under writes on other threads
            entry = self._index.get(key)
        return None if entry is None else entry.slot

    def items(self) -> list[tuple[BlockKey, int]]:
        return list(zip(*self.keys_and_slots()))

    def keys_and_slots(self) -> tuple[list[BlockKey], list[int]]:
        """Every stored block's key and slot (a million at 1M tokens: two lists, no tuple each)."""
        with self._lock:
            return self._index.keys_and_slots()

    def __len__(self) -> int:
        return len(self._index)

    def index_nbytes(self) -> int:
        """The bytes of the index's arrays: each slot's key, checksum and hash cells."""
        with self._lock:
            return self._index.nbytes()

    # -- block I/O -----------------------------------------------------------
    def write(self, items: Sequence[tuple[BlockKey, int, torch.Tensor]], *, priority: int = URGENT,
              aligned: bool = False) -> None:
        """Write blocks into their RESERVED slots, then make them visible; all or nothing.
        ``priority``: the I/O's place among the store's queued jobs (see tierkv.tiers.nvme_striped);
        ``aligned``: the caller vouches that every buffer starts on an ALIGN boundary (the slots of
        a host tier do), which spares checking each one."""
        self._check_open()
        if not items:
            return
        slots = [slot for _, slot, _ in items]
        self._check_slots(slots)
        bufs = [block_buffer(tensor, self.block_bytes, self.backend) for _, _, tensor in items]
        misaligned = set() if aligned else misaligned_of((t for _, _, t in items), self._file.needs_alignment)
        self._share.owner.check()
        self._grow_to((max(slots) + 1) * self.block_bytes)
        digests = [key.digest for key, _, _ in items]
        with disk_full_raised(self.directory, len(items) * self.block_bytes):
            job = self._io.start_write(slots, bufs, misaligned, priority=priority)
            try:  # while the workers write: the checksums, and the records that carry them
                sums = job.checksums()
                records = encode_puts(digests, slots, sums)
            finally:
                job.wait()
        failpoint("nvme.after-data")
        with self._lock:
            with disk_full_raised(self.directory, len(records)):
                self._journal.append_encoded(records)
            for digest, slot, checksum in self._index.put_many(digests, slots, sums):
                self._view.unshown(digest, slot, checksum)    # a block this process wrote anew
            self._view.written(digests)

    def read(self, items: Sequence[tuple[BlockKey, int, torch.Tensor]], *, priority: int = URGENT,
             aligned: bool = False, addresses: np.ndarray | None = None) -> list[BlockKey]:
        """Read blocks into the given tensors; the keys that failed (their tensors hold garbage): a
        checksum that does not match, a short read, or a key no longer in that slot. A `StoreReadError`
        where the device answered a read with an error: the blocks are kept, and the read may be tried
        again. ``priority`` and ``aligned`` as for `write`. ``addresses``: the tensors are flat uint8 host
        arrays (a host tier's ``buffers``) starting there, on `ALIGN` boundaries, so none is asked
        (a native read of a sparse layer's ~500 pages then prepares no request block by block)."""
        self._check_open()
        keys = list(map(itemgetter(0), items))
        asked = np.fromiter(map(itemgetter(1), items), np.int64, count=len(items))
        with self._lock:
            found, expected = self._index.find_many(keys)
        here = found == asked   # a key gone, or now in another slot, fails
        if here.all():
            kept, tensors = None, list(map(itemgetter(2), items))
        else:
            kept = np.flatnonzero(here)
            tensors = [items[i][2] for i in kept.tolist()]
        slots, expected = asked[here].tolist(), expected[here].tolist()
        sums: list[int | None] = []
        if slots and addresses is not None:
            sums = self._io.read(slots, tensors, set(), priority=priority,
                                 addresses=addresses if kept is None else addresses[kept])
        elif slots:
            bufs = [block_buffer(tensor, self.block_bytes, self.backend) for tensor in tensors]
            misaligned = set() if aligned else misaligned_of(tensors, self._file.needs_alignment)
            sums = self._io.read(slots, bufs, misaligned, priority=priority)
        if kept is None and sums == expected:
            return []
        if UNREADABLE in sums:
            raise StoreReadError(errno.EIO, f"{self.directory}: the device failed {sums.count(UNREADABLE)} of "
                                 f"{len(sums)} block read(s) with an I/O error; the blocks are kept: read them "
                                 f"again, or check the disk ({os.strerror(errno.EIO)})")
        ok = np.zeros(len(items), bool)
        ok[np.flatnonzero(here)] = [got == want for got, want in zip(sums, expected)]
        return list(compress(keys, (~ok).tolist()))

    def drop(self, key: BlockKey, slot: int | None = None) -> None:
        """Forget ``key``; the caller then releases its pool slot. A block in this process's slots
        is gone for every process (journal DROP_AT); one in an unclaimed extent too, once this process
        has claimed the extent; one in another live process's slot is forgotten here only (its slot is
        kept: once that process leaves and this one takes the extent, the block is this one's own).
        ``slot``: only the copy in that slot (a key written again elsewhere keeps that copy)."""
        self._check_open()
        with self._lock:
            entry = self._index.get(key)
            if entry is None or slot is not None and entry.slot != slot:
                return
            self._index.drop(key.digest)
            if self.pool.claim_extent_of(entry.slot):
                self._drop_at(key.digest, entry.slot)
            else:
                self._view.unshown(key.digest, entry.slot, entry.checksum)
            self._view.dropped(key.digest)      # its other copies in this process's slots go too

    def forget(self, key: BlockKey, slot: int) -> None:
        """Stop showing here the block another process wrote in ``slot`` (nothing is journaled);
        the caller then releases the slot. For a manager that holds or writes its own copy."""
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and entry.slot == slot:
                self._index.drop(key.digest, slot)
                self._view.unshown(key.digest, slot, entry.checksum)

    def refresh(self) -> Changes:
        """Take in what other processes journaled since the last look: the blocks that became
        visible and those that are gone, as (key, slot). One fstat when nothing changed. It adds
        READY records to `pool`, so it runs on the thread that uses the pool."""
        self._check_open()
        with self._lock:
            self._catch_up()
            changes, self._news = self._news, Changes()
            changes.added = self._view.still_shown(changes.added)
        return changes

    def hold_back(self, key: BlockKey, slot: int) -> None:
        """A block `refresh` reported added that the manager cannot take in yet (it still holds an older
        copy, which a reader uses): reported again at the next `refresh`."""
        with self._lock:
            self._news.added.append((key, slot))

    def _drop_at(self, digest: bytes, slot: int) -> None:
        """Journal that the copy in ``slot`` (this process's) is gone."""
        try:
            self._journal.append([Record(Op.DROP_AT, BlockKey(digest), slot)])
        except OSError as exc:  # safe: a stale entry fails its checksum, or its slot's next PUT evicts it
            log.warning("%s: DROP of %s not journaled: %s", self.directory, BlockKey(digest), exc)

    def _adopted(self, first: int, end: int) -> None:
        """The pool took slots ``[first, end)`` as this process's: the blocks live there come in."""
        with self._lock:
            self._view.adopted(first, end)
            self._news.extend(self._view.changes())

    def _catch_up(self) -> None:
        """The journal's records since the last look, kept for the next `refresh`; also run by the pool
        before it takes an extent, so that blocks another process wrote there (it closed or died since)
        are not taken for free slots and written over."""
        with self._lock:
            self._news.extend(self._view.apply(self._journal.tail()))

    # -- lifecycle -----------------------------------------------------------
    def flush(self) -> None:
        """Make everything written so far durable: fsync slots.dat, then index.log."""
        self._check_open()
        with self._lock:
            os.fsync(self._file.fd)
            self._journal.fsync()

    def close(self) -> None:
        """Flush, then leave the store: this process's extents become unclaimed (its blocks stay)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            closed_here(self)
            self._release_files()

    def forsake(self) -> None:
        """In a child forked from the process that has the store open: let go of the inherited files,
        giving nothing back (they are the parent's). Kept, the owner file's lock would make a parent
        that died look alive while the child lives (its slots never reclaimed), and the child would
        count as an opener, so that none is ever alone to repair the store."""
        self._closed, self._forked_from = True, self._share.owner_pid
        self._share.forsake()       # first: the owner file's lock above all
        for part, attr in ((getattr(self, "_file", None), "fd"), (getattr(self, "_journal", None), "_fd")):
            fd = getattr(part, attr, -1)    # the descriptors alone: not a backend's close, nor the I/O
            if isinstance(fd, int) and fd >= 0:    # workers (a forked child has none of them)
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(part, attr, -1)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._index)} blocks"
        return (f"NvmeTier({str(self.directory)!r}, backend={getattr(self, 'backend', None)!r}, "
                f"block_bytes={self.block_bytes}, slots={self._capacity}, {state})")

    # -- internals -----------------------------------------------------------
    def _recover(self) -> None:
        """Hide entries the data cannot back (alone: journal it, compact); mark visible slots READY."""
        lost = self._journal.state.lost   # left out of the index by the replay
        if lost:
            log.warning("%s: %d block(s) lie past the budget or past the end of slots.dat; %s", self.directory,
                        len(lost), "dropped" if self._share.alone else "hidden from this process")
        if self._share.alone:   # (and older copies of blocks the index shows: nobody else holds them)
            self._repair([Record(Op.DROP_AT, key, slot) for key, slot in lost] +
                         [Record(Op.DROP_AT, BlockKey(digest), slot) for digest, slot, _ in self._journal.state.extra])
        self.pool.restore(self._index.slot_array())

    def _repair(self, drops: list[Record]) -> None:
        """Journal ``drops``, or compact the journal if it is mostly garbage (only when alone)."""
        state = self._journal.state
        try:
            if state.damaged or state.garbage > max(COMPACT_MIN_GARBAGE, len(self._index)):   # (lost ones included)
                self._journal.rewrite(self._index)
            elif drops:
                self._journal.append(drops)
        except OSError as exc:  # e.g. a full disk: the store still opens, checksums still guard reads
            log.warning("%s: could not compact or update the journal: %s", self.directory, exc)

    def _grow_to(self, end: int) -> None:
        """Make slots.dat at least ``end`` bytes long. One process at a time (under the claims lock)
        grows it from its real size, which another may have grown: only a failed growth is cut back."""
        if end <= self._data_size:
            return
        with self._share.claims.locked():
            current = os.fstat(self._file.fd).st_size
            self._data_size = max(self._data_size, current)
            if end > current:
                self._data_size = self._allocate(current, end)

    def _allocate(self, current: int, end: int) -> int:
        """fallocate from ``current`` to a good size of at least ``end``; the new size."""
        target = min(self.budget_bytes, max(end, 2 * current, current + GROW_MIN))
        for size in dict.fromkeys((target, end)):
            try:
                os.posix_fallocate(self._file.fd, current, size - current)
            except OSError as exc:
                os.ftruncate(self._file.fd, current)  # give back a partial allocation
                if exc.errno not in DISK_FULL:
                    raise
                continue
            return size
        extent = self._share.claims.extent_slots * self.block_bytes
        past = "" if self.pool.owns(current // self.block_bytes) else (   # the file grows over slots not its own
            f" (processes sharing a store each take whole extents of {format_size(extent)} of slots, and this "
            f"one's lie past others': or give it a --nvme-dir of its own)")
        raise disk_full(self.directory, end - current, why=past)

    def _check_slots(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError("write: the same slot appears twice in one batch")
        bad = [s for s in slots if not 0 <= s < self._capacity]
        if bad:
            raise ValueError(f"write: slot(s) {bad[:5]} outside 0..{self._capacity - 1}")
        foreign = [s for s in slots if not self.pool.owns(s)]
        if foreign:
            raise ValueError(f"write: slot(s) {foreign[:5]} are not in this process's extents; "
                             f"write into slots reserved from tier.pool")

    def _check_open(self) -> None:
        if self._closed and self._forked_from is not None:
            raise StoreUnusable(f"NVMe store {self.directory} was opened by process {self._forked_from}, "
                                f"which this process was forked from: open it again in this process")
        if self._closed:
            raise ValueError(f"NVMe store {self.directory} is closed")

    def _release_files(self) -> None:
        try:
            for part in ("_io", "_file", "_journal"):
                if hasattr(self, part):
                    getattr(self, part).close()
        finally:
            self._share.leave(self.pool.give_back() if hasattr(self, "pool") else [])


def _validate(block_bytes: int, budget_bytes: int, io_threads: int) -> None:
    if block_bytes <= 0:
        raise ConfigError(f"block_bytes={block_bytes}: must be > 0")
    if budget_bytes < block_bytes:
        raise ConfigError(f"budget_bytes={budget_bytes}: must hold at least one block (block_bytes={block_bytes})")
    if io_threads <= 0:
        raise ConfigError(f"io_threads={io_threads}: must be > 0")
