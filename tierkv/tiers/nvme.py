"""The NVMe tier: a persistent, crash-safe, content-addressed block store.

A store is one directory (0700; every file 0600)::

    DIR/
      store.json   manifest: {"format": "tierkv-nvme", "version": 1, "block_bytes",
                   "namespace", "created"}; reopening with another block_bytes or
                   namespace is a ConfigError
      slots.dat    slot i at offset i * block_bytes; grown with fallocate (doubling, at
                   least 64 MiB a step, exactly what is needed when that does not fit,
                   never past the budget)
      index.log    journal of 48-byte PUT/DROP records (see tierkv.tiers.journal)
      lock         flock'ed while open: a second opener gets StoreLocked

    slots.dat  |  slot 0  |  slot 1  |  slot 2  | ... |  slot n-1  |   n = budget // block_bytes
               0          B          2B         3B               (n)B  B = block_bytes
    index.log  | PUT k7 @0 c | PUT k3 @2 c | DROP k7 | PUT k9 @0 c | ...   (c = xxh3_64 of the bytes)

Write order makes a block visible only after its bytes are written: data to
``slots.dat`` first (the I/O workers write while the calling thread takes the
checksums and encodes the records, see tierkv.tiers.nvme_striped), then one
batched append of PUT records to ``index.log`` once every byte is written,
then the in-memory index. A crash at any point leaves the journal a valid
prefix (replay cuts a torn tail) and every visible entry either holds the
right bytes or fails its checksum on read; nothing wrong is ever served.
Nothing is fsync'd until `NvmeTier.flush` (or close): a process crash loses
nothing written, a power loss may lose the newest blocks but never serves
them wrong.

Open replays the journal, hides entries whose slot lies past the budget or
past the end of ``slots.dat`` (a DROP is journaled for them), compacts the
journal when it is mostly garbage, and marks every visible slot READY in
`pool`. The pool is the manager's: `write` expects RESERVED slots and
changes no state; `drop` leaves the slot for the caller to release.

A `write` batch is all or nothing: on any error (ENOSPC becomes DiskFullError,
naming the directory and the bytes needed) none of its blocks becomes visible.
``backend="auto"`` defers to ``TIERKV_NVME_BACKEND`` and otherwise takes the
first of kvikio, odirect, buffered that passes a real probe in the directory
(tierkv.tiers.nvme_io); an explicit backend that fails its probe is a ConfigError.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from tierkv.knobs import IOKnobs

from tierkv.sizes import format_size
from tierkv.device import ALIGN
from tierkv.errors import ConfigError, DiskFullError, StoreLocked
from tierkv.keys import BlockKey
from tierkv.tiers.base import Medium
from tierkv.tiers.journal import Journal, Op, Record, encode_puts
from tierkv.tiers.nvme_io import BACKENDS, Buffer, choose_backend, fsync_dir
from tierkv.tiers.nvme_striped import URGENT, StripedIO
from tierkv.tiers.pool import BlockPool

log = logging.getLogger(__name__)

FORMAT = "tierkv-nvme"
VERSION = 1
GROW_MIN = 64 * 1024**2
COMPACT_MIN_GARBAGE = 4096  # compact when garbage records exceed this and the live ones
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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
        self.pool = BlockPool(budget_bytes // block_bytes)
        self._lock = threading.Lock()
        self._closed = True
        _make_private_dir(self.directory)
        self._lock_fd = _acquire_lock(self.directory / "lock")
        try:
            _check_manifest(self.directory, block_bytes, namespace)
            if backend == "auto":  # TIERKV_NVME_BACKEND overrides only the automatic choice
                backend = IOKnobs.from_env().nvme_backend
            self.backend = choose_backend(backend, self.directory, block_bytes)
            self._file = BACKENDS[self.backend](self.directory / "slots.dat")
            self._data_size = os.fstat(self._file.fd).st_size
            self._journal = Journal(self.directory / "index.log")
            self._index = self._journal.state.index
            self._io = StripedIO(self._file, block_bytes, io_threads)
            self._recover()
        except BaseException:
            self._release_files()
            raise
        self._closed = False

    # -- queries -----------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    def lookup(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry.slot

    def items(self) -> list[tuple[BlockKey, int]]:
        with self._lock:
            return [(key, entry.slot) for key, entry in self._index.items()]

    def __len__(self) -> int:
        return len(self._index)

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
        bufs = [self._buffer(tensor) for _, _, tensor in items]
        misaligned = set() if aligned else self._misaligned(tensor for _, _, tensor in items)
        with self._lock:
            self._grow_to((max(slots) + 1) * self.block_bytes)
        digests = [key.digest for key, _, _ in items]
        with self._disk_full_raised(len(items) * self.block_bytes):
            job = self._io.start_write(slots, bufs, misaligned, priority=priority)
            try:  # while the workers write: the checksums, and the records that carry them
                sums = job.checksums()
                records = encode_puts(digests, slots, sums)
            finally:
                job.wait()
        with self._lock:
            with self._disk_full_raised(len(records)):
                self._journal.append_encoded(records)
            for digest, slot, checksum in zip(digests, slots, sums):
                self._index.put(digest, slot, checksum)

    def read(self, items: Sequence[tuple[BlockKey, int, torch.Tensor]], *, priority: int = URGENT,
             aligned: bool = False) -> list[BlockKey]:
        """Read blocks into the given tensors; the keys that failed (their tensors hold garbage).
        ``priority`` and ``aligned`` as for `write`."""
        self._check_open()
        with self._lock:
            entries = [self._index.get(key) for key, _, _ in items]
        failed: set[BlockKey] = set()
        wanted: list[tuple[BlockKey, int]] = []
        slots: list[int] = []
        tensors: list[torch.Tensor] = []
        for (key, slot, tensor), entry in zip(items, entries):
            if entry is None or entry.slot != slot:
                failed.add(key)
                continue
            wanted.append((key, entry.checksum))
            slots.append(slot)
            tensors.append(tensor)
        if slots:
            bufs = [self._buffer(tensor) for tensor in tensors]
            misaligned = set() if aligned else self._misaligned(tensors)
            sums = self._io.read(slots, bufs, misaligned, priority=priority)
            failed.update(key for (key, expected), got in zip(wanted, sums) if got != expected)
        return [key for key, _, _ in items if key in failed]

    def drop(self, key: BlockKey) -> None:
        """Forget ``key`` (journal DROP + index); the caller then releases its pool slot."""
        self._check_open()
        with self._lock:
            if self._index.get(key) is None:
                return
            self._index.drop(key.digest)
            try:
                self._journal.append([Record(Op.DROP, key)])
            except OSError as exc:  # safe: a stale entry fails its checksum, or its slot's next PUT evicts it
                log.warning("%s: DROP of %s not journaled: %s", self.directory, key, exc)

    # -- lifecycle -----------------------------------------------------------
    def flush(self) -> None:
        """Make everything written so far durable: fsync slots.dat, then index.log."""
        self._check_open()
        with self._lock:
            os.fsync(self._file.fd)
            self._journal.fsync()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._release_files()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._index)} blocks"
        return (f"NvmeTier({str(self.directory)!r}, backend={getattr(self, 'backend', None)!r}, "
                f"block_bytes={self.block_bytes}, slots={self.pool.capacity}, {state})")

    # -- internals -----------------------------------------------------------
    def _recover(self) -> None:
        """Hide entries the data cannot back, compact if worthwhile, mark visible slots READY."""
        state = self._journal.state
        whole_slots = min(self.pool.capacity, self._data_size // self.block_bytes)
        lost = [key for key, entry in self._index.items() if entry.slot >= whole_slots]
        if lost:
            log.warning("%s: %d block(s) lie past the budget or past the end of slots.dat; dropped",
                        self.directory, len(lost))
            for key in lost:
                self._index.drop(key.digest)
        garbage = state.garbage + len(lost)
        try:
            if state.damaged or garbage > max(COMPACT_MIN_GARBAGE, len(self._index)):
                self._journal.rewrite(self._index)
            elif lost:
                self._journal.append(Record(Op.DROP, key) for key in lost)
        except OSError as exc:  # e.g. a full disk: the store still opens, checksums still guard reads
            log.warning("%s: could not compact or update the journal: %s", self.directory, exc)
        self.pool.restore(self._index.slots())

    def _grow_to(self, end: int) -> None:
        """Make slots.dat at least ``end`` bytes long (caller holds the lock)."""
        current = self._data_size
        if end <= current:
            return
        target = min(self.budget_bytes, max(end, 2 * current, current + GROW_MIN))
        for size in dict.fromkeys((target, end)):
            try:
                os.posix_fallocate(self._file.fd, current, size - current)
            except OSError as exc:
                os.ftruncate(self._file.fd, current)  # give back a partial allocation
                if exc.errno not in _DISK_FULL:
                    raise
                continue
            self._data_size = size
            return
        raise self._disk_full(end - current)

    def _buffer(self, tensor: torch.Tensor | np.ndarray) -> Buffer:
        """A flat uint8 view of ``tensor``'s bytes, without copying (a host tier's
        ``buffers`` are such views already)."""
        if type(tensor) is np.ndarray:
            if tensor.dtype == np.uint8 and tensor.nbytes == self.block_bytes and tensor.flags.c_contiguous:
                return tensor.reshape(-1) if tensor.ndim != 1 else tensor
            raise ValueError(f"block array: {tensor.shape} {tensor.dtype}, contiguous={tensor.flags.c_contiguous}"
                             f"; expected {self.block_bytes} contiguous bytes")
        try:
            array = tensor.numpy()  # the common case, kept cheap: a flat uint8 CPU block
        except (TypeError, RuntimeError):
            array = None
        if array is not None and array.dtype == np.uint8 and array.nbytes == self.block_bytes \
                and array.flags.c_contiguous:
            return array if array.ndim == 1 else array.reshape(-1)
        if tensor.nbytes != self.block_bytes or not tensor.is_contiguous():
            raise ValueError(f"block tensor: {tuple(tensor.shape)} {tensor.dtype}, contiguous="
                             f"{tensor.is_contiguous()}; expected {self.block_bytes} contiguous bytes")
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            return flat.numpy()
        if self.backend != "kvikio":
            raise ValueError(f"a {flat.device} block needs the kvikio backend (this store uses {self.backend})")
        return flat

    def _misaligned(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Positions of the tensors O_DIRECT cannot use in place (they need a bounce buffer)."""
        if not self._file.needs_alignment:
            return set()
        return {i for i, tensor in enumerate(tensors) if _address(tensor) % ALIGN}

    def _check_slots(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError("write: the same slot appears twice in one batch")
        bad = [s for s in slots if not 0 <= s < self.pool.capacity]
        if bad:
            raise ValueError(f"write: slot(s) {bad[:5]} outside 0..{self.pool.capacity - 1}")

    @contextlib.contextmanager
    def _disk_full_raised(self, needed: int) -> Iterator[None]:
        """Turn ENOSPC/EDQUOT from the block into DiskFullError, naming the ``needed`` bytes."""
        try:
            yield
        except OSError as exc:
            if exc.errno in _DISK_FULL and not isinstance(exc, DiskFullError):
                raise self._disk_full(needed) from exc
            raise

    def _disk_full(self, needed: int) -> DiskFullError:
        fs = os.statvfs(self.directory)
        return DiskFullError(errno.ENOSPC, f"NVMe store {self.directory}: no space left for "
                             f"{format_size(needed)} ({needed} bytes) more; {format_size(fs.f_bavail * fs.f_frsize)} "
                             f"free. Free disk space or lower the NVMe budget")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"NVMe store {self.directory} is closed")

    def _release_files(self) -> None:
        try:
            for part in ("_io", "_file", "_journal"):
                if hasattr(self, part):
                    getattr(self, part).close()
        finally:
            os.close(self._lock_fd)  # releases the flock


# -- directory, lock, manifest --------------------------------------------
def _validate(block_bytes: int, budget_bytes: int, io_threads: int) -> None:
    if block_bytes <= 0:
        raise ConfigError(f"block_bytes={block_bytes}: must be > 0")
    if budget_bytes < block_bytes:
        raise ConfigError(f"budget_bytes={budget_bytes}: must hold at least one block (block_bytes={block_bytes})")
    if io_threads <= 0:
        raise ConfigError(f"io_threads={io_threads}: must be > 0")


def _make_private_dir(directory: Path) -> None:
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask


def _acquire_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLocked(f"NVMe store {path.parent} is open elsewhere (pid {holder}); "
                          f"close it there or use another directory") from None
    with contextlib.suppress(OSError):  # the pid only helps the message above; a full disk may refuse it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _check_manifest(directory: Path, block_bytes: int, namespace: str) -> None:
    path = directory / "store.json"
    if not path.exists():
        found = [name for name in ("slots.dat", "index.log") if (directory / name).exists()]
        if found:
            raise ConfigError(f"NVMe store {directory}: has {', '.join(found)} but no store.json; "
                              f"not a tierkv store, or a damaged one")
        _write_manifest(path, block_bytes, namespace)
        return
    try:
        manifest = json.loads(path.read_text())
        stored = (manifest["format"], manifest["version"], manifest["block_bytes"], manifest["namespace"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"NVMe store {directory}: unreadable store.json ({exc})") from None
    if stored[:2] != (FORMAT, VERSION):
        raise ConfigError(f"NVMe store {directory}: format {stored[0]!r} v{stored[1]}; "
                          f"this tierkv reads {FORMAT!r} v{VERSION}")
    if stored[2:] != (block_bytes, namespace):
        raise ConfigError(f"NVMe store {directory} holds block_bytes={stored[2]}, namespace={stored[3]!r}; "
                          f"asked for block_bytes={block_bytes}, namespace={namespace!r}: "
                          f"open it with those values or use another directory")


def _write_manifest(path: Path, block_bytes: int, namespace: str) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "block_bytes": block_bytes, "namespace": namespace,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (json.dumps(manifest, indent=2) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _address(block: torch.Tensor | np.ndarray) -> int:
    return block.__array_interface__["data"][0] if type(block) is np.ndarray else block.data_ptr()
