"""One NVMe store, several processes: who has it open, who owns which slots, what only one may do.

Beside the store's data (see tierkv.tiers.nvme), every process that has it open holds::

    DIR/lock          flock LOCK_SH while open (LOCK_EX while an opener is alone)
    DIR/owners/ID     this process's owner file (its pid), flock LOCK_EX while open:
                      an owner whose file is gone or can be locked is dead
    DIR/claims        the extent table; flock LOCK_EX around every look or change

    claims  | "TKVC" | version | E   | pad | owner of extent 0 | owner of extent 1 | ...
            0        4         8     12    16                  24                  32
            u32 LE each; owners are u64 LE ids, 0 = unclaimed; E (slots per extent) is set by
            the store's creator: 64 MiB of slots, at most an eighth of its budget, at least one
    slots   | extent 0: slots 0..E-1 | extent 1: slots E..2E-1 | ...

Opening is serialised by the claims lock. Inside it an opener tries ``lock``
with LOCK_EX|LOCK_NB. If it gets it, no other process has the store open, and
it alone does what must not run beside another process: cut a torn journal
tail, compact the journal, drop blocks past a smaller budget; then it
downgrades to LOCK_SH. Otherwise it takes LOCK_SH and skips those steps (the
next opener that finds itself alone does them). A process that holds ``lock``
exclusively outside this protocol (a tierkv from before shared stores) makes
the opener raise StoreLocked.

A process writes only into slots of the extents it claimed, so no two
processes ever write one slot; it reads any slot, and every read is verified
by its checksum, so a slot rewritten under a reader fails, never serves wrong
bytes. Claims, all under the claims lock:

    claim      the lowest unclaimed extent that has a free slot, when the process has no
               free slot of its own, while it holds less than an equal share of the extents
               among the processes that have the store open; to drop a block in an unclaimed
               extent, it claims it first (within the same share)
    adopt      a claimed extent's blocks stay visible: they become the claimer's own
    reap       at open, and when a claim finds nothing: the extents of dead owners become
               unclaimed (their blocks stay) and their owner files are removed
    give back  on close, a process's extents become unclaimed (its blocks stay)

A process killed mid-write therefore loses no slot for good: its extents come
back at the next open or at the first claim that finds no free extent.

The budget is the store's: ``slots.dat`` never grows past the budget of the
process that grows it, and each process claims only extents below its own
budget (give every process the same one). Extents are claimed as they are
needed, first come, first served, each process up to an equal share among
those that have the store open at the time (all of it when it is alone). A
process keeps what it claimed until it closes, and reuses its own slots (its
manager evicts its own blocks) once it may claim no more. Nothing is taken
back from a live process: one that opens a store already filled by another
writes nothing to it until that one closes (its writes there raise
BudgetExceeded naming the holders), while it reads every block.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import struct
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

from tierkv.errors import ConfigError, StoreLocked, StoreUnusable
from tierkv.tiers.nvme_io import open_private, wait_flock
from tierkv.tiers.nvme_manifest import check_manifest

log = logging.getLogger(__name__)

EXTENT_BYTES = 64 * 1024**2
MIN_EXTENTS = 8          # a budget splits into at least this many extents (one slot each when it is smaller)
_MAGIC, _VERSION = b"TKVC", 1
_HEADER = struct.Struct("<4sII")   # magic, version, extent slots
_TABLE_AT = 16
_OWNER = struct.Struct("<Q")
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def extent_slots(capacity: int, block_bytes: int) -> int:
    """Slots per extent for a new store: 64 MiB, at most an eighth of the budget, at least one."""
    return max(1, min(EXTENT_BYTES // block_bytes, capacity // MIN_EXTENTS))


def make_private_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        return
    os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask


def prepare_store_dir(directory: Path, label: str | None = None) -> None:
    """Make a store's directory (private, as the store makes it) and try a write there, or say why it
    cannot be used, before any KV is computed for it. ``label``: how errors name it (``--nvme-dir DIR``)."""
    label = label or f"--nvme-dir {directory}"
    try:
        make_private_dir(directory)
    except OSError as error:
        raise ConfigError(f"{label}: cannot create the store's directory: "
                          f"{error.strerror or error}") from None
    if not directory.is_dir():
        raise ConfigError(f"{label}: exists and is not a directory")
    try:
        nested = "store.json" in os.listdir(directory)   # (one store's folder: a store in it would be nested, empty)
    except OSError as error:
        raise ConfigError(f"{label}: cannot look into it ({error.strerror or error}); the store's directory must "
                          "belong to this user (tierkv makes it 0700)") from None
    if nested:
        raise ConfigError(f"{label}: is the folder of one store (it holds a store.json); give the directory above "
                          f"it ({directory.resolve().parent}), which keeps a store for each model and settings")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ConfigError(f"{label}: the store cannot write there ({error.strerror or error}); "
                          f"give a writable directory") from None


class Claims:
    """``claims``: which owner holds each extent of slots.

    flock does not exclude two threads that share one descriptor, so a mutex
    serialises this process's own users (the loop claims, I/O workers grow
    ``slots.dat`` under the same lock)."""

    def __init__(self, directory: Path) -> None:
        self.owners = directory / "owners"
        self.fd = open_private(directory / "claims")
        self.extent_slots = 0
        self._mutex = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if self.fd < 0:
            raise StoreUnusable(f"NVMe store {self.owners.parent} is closed here (or was opened by the process "
                                f"this one was forked from): open it again")
        with self._mutex:
            try:
                wait_flock(self.fd, fcntl.LOCK_EX, f"NVMe store {self.owners.parent}")
            except OSError as exc:
                if exc.errno in _NO_FLOCK:
                    raise StoreUnusable(f"NVMe store {self.owners.parent}: the file system does not support "
                                        f"flock ({os.strerror(exc.errno)}), which processes sharing a store "
                                        f"need; put the store on a local file system (ext4, xfs, tmpfs)") from None
                raise
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def set_geometry(self, wanted: int) -> None:
        """Take the store's extent size, writing ``wanted`` if the table is new (caller holds the lock)."""
        head = os.pread(self.fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:  # new, or torn while it was created: nothing was claimed yet
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, _HEADER.pack(_MAGIC, _VERSION, wanted).ljust(_TABLE_AT, b"\0"), 0)
            self.extent_slots = wanted
            return
        magic, version, slots = _HEADER.unpack(head)
        if (magic, version) != (_MAGIC, _VERSION) or slots <= 0:
            raise ConfigError(f"NVMe store {self.owners.parent}: claims is not a tierkv claims table "
                              f"(v{_VERSION}); a damaged store or another program's directory")
        self.extent_slots = slots

    def read(self) -> list[int]:
        """The owner of each extent recorded so far (later extents are unclaimed)."""
        raw = os.pread(self.fd, max(0, os.fstat(self.fd).st_size - _TABLE_AT), _TABLE_AT)
        n = len(raw) // _OWNER.size
        return list(struct.unpack(f"<{n}Q", raw[:n * _OWNER.size]))

    def write(self, extent: int, owner: int) -> None:
        os.pwrite(self.fd, _OWNER.pack(owner), _TABLE_AT + extent * _OWNER.size)

    def give_back(self, extents: Iterable[int], owner: int) -> None:
        table = self.read()
        for extent in extents:
            if extent < len(table) and table[extent] == owner:
                self.write(extent, 0)

    def reap(self, table: list[int], me: int) -> None:
        """Unclaim the extents of dead owners, in ``table`` and on disk, and remove their owner files."""
        suspects = (set(table) | _owner_ids(self.owners)) - {0, me}
        dead = {owner for owner in suspects if not _alive(self.owners / _name(owner))}
        for extent, owner in enumerate(table):
            if owner in dead:
                table[extent] = 0
                self.write(extent, 0)

    def openers(self) -> int:
        """How many processes have the store open (owner files; a dead one's until it is reaped)."""
        return len(_owner_ids(self.owners))

    def pids(self, owners: Iterable[int]) -> list[str]:
        """The pids the owner files of ``owners`` name (for messages)."""
        pids = []
        for owner in sorted(set(owners) - {0}):
            with contextlib.suppress(OSError):
                pids.append((self.owners / _name(owner)).read_text().strip() or "?")
        return pids

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Owner:
    """This process's owner file: held locked while the store is open, removed on close."""

    def __init__(self, directory: Path) -> None:
        make_private_dir(directory)
        self.id = secrets.randbits(64) or 1
        self.path = directory / _name(self.id)
        self.fd = open_private(self.path, os.O_EXCL)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(OSError):  # the pid only helps messages; a full disk may refuse it
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def check(self) -> None:
        """Raise if the owner file was removed: other processes would take this process's slots."""
        if os.fstat(self.fd).st_nlink == 0:
            raise StoreUnusable(f"NVMe store {self.path.parent.parent}: this process's owner file "
                                f"{self.path.name} was removed, so other processes may reuse its slots; "
                                f"close and reopen the store (never delete files under owners/)")

    def close(self) -> None:
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)  # releases the flock
            self.fd = -1


class Membership:
    """This process's part in a store: the shared lock, its owner file and the claims table.

    `join` and `settle` run inside ``claims.locked()``, the gate that serialises opens."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        make_private_dir(directory)
        self.claims = Claims(directory)
        self.owner: Owner | None = None
        self.alone = False   # no other process had the store open: the exclusive steps are this opener's
        self._lock_fd = -1
        self._pid = os.getpid()

    def join(self, capacity: int, block_bytes: int, namespace: str) -> None:
        """Hold the store (alone if no other process has it), register, check its manifest, reap."""
        self._lock_fd, self.alone = _take_lock(self.directory / "lock")
        check_manifest(self.directory, block_bytes, namespace)
        self.owner = Owner(self.claims.owners)
        self.claims.set_geometry(extent_slots(capacity, block_bytes))
        self.claims.reap(self.claims.read(), self.owner.id)

    def settle(self) -> None:
        """After the exclusive steps: share the store like every other process."""
        if not self.alone:
            return
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(self.directory / "lock") from None
        self.alone = False

    @property
    def owner_pid(self) -> int:
        """The process that joined (this one, unless it was forked since)."""
        return self._pid

    def forsake(self) -> None:
        """In a child forked from the process that joined: close the inherited descriptors, giving back
        and removing nothing (a lock is shared by every descriptor of the open file, so the parent's
        locks hold as long as the parent does, and go when it dies)."""
        for holder, attr in ((self.claims, "fd"), (self.owner, "fd"), (self, "_lock_fd")):
            fd = getattr(holder, attr, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(holder, attr, -1)

    def leave(self, extents: Iterable[int]) -> None:
        """Give back ``extents``, remove the owner file, release the lock. Safe on a partial open."""
        try:
            if self.owner is not None and self.owner.fd >= 0:
                with self.claims.locked():
                    self.claims.give_back(extents, self.owner.id)
                self.owner.close()
        finally:
            self.claims.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _take_lock(path: Path) -> tuple[int, bool]:
    """``lock`` held shared; True if it could be held exclusively (no other process has the store)."""
    fd = open_private(path)
    try:
        for mode, alone in ((fcntl.LOCK_EX, True), (fcntl.LOCK_SH, False)):
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return fd, alone
            except BlockingIOError:
                continue
        raise _locked(path)
    except BaseException:
        os.close(fd)
        raise


def _locked(path: Path) -> StoreLocked:
    try:  # a tierkv from before shared stores wrote its pid here
        holder = path.read_text().strip() or "unknown"
    except OSError:
        holder = "unknown"
    return StoreLocked(f"NVMe store {path.parent} is held exclusively by another process (pid {holder}), "
                       f"a tierkv that cannot share stores; close it there, upgrade it, or use another directory")


def _alive(path: Path) -> bool:
    """Whether a live process holds the owner file at ``path``; a dead one's file is removed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


def _owner_ids(directory: Path) -> set[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return set()
    return {int(name, 16) for name in names if len(name) == 16 and _is_hex(name)}


def _is_hex(name: str) -> bool:
    return all(c in "0123456789abcdef" for c in name)


def _name(owner: int) -> str:
    return f"{owner:016x}"


# -- forks ---------------------------------------------------------------------------
_OPEN: weakref.WeakSet = weakref.WeakSet()   # stores this process has open (NvmeTier)


def opened_here(store: object) -> None:
    """``store`` (with a ``forsake()``) is open in this process: a child forked from it lets go of it."""
    _OPEN.add(store)


def closed_here(store: object) -> None:
    _OPEN.discard(store)


def _forsake_after_fork() -> None:
    """In a child forked without exec: every store the parent had open lets go of its inherited files
    (an inherited owner lock would keep a parent that died alive while the child lives)."""
    for store in list(_OPEN):
        try:
            store.forsake()
        except Exception:  # noqa: BLE001 - one store's failure must not leave the others' locks held
            log.exception("NVMe store %s: letting go of it in a forked child failed", store.directory)
    _OPEN.clear()


os.register_at_fork(after_in_child=_forsake_after_fork)
