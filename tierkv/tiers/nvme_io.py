"""Block files for the NVMe tier: three backends, the probes that pick one, the store's file locks, and
what a full disk or a store this user cannot write raises.

Backends, in the order ``auto`` tries them (each must pass a real 4 KiB
write + read in the store's directory, see `probe_backends`):

=========  ==============================================================
kvikio     cuFile / GPUDirect Storage; host or CUDA buffers. Tried only
           when ``libcuda.so.1`` loads: kvikio imports without a driver
           but then fails every I/O, so it is never imported otherwise.
odirect    ``os.preadv``/``os.pwritev`` on an ``O_DIRECT`` descriptor:
           no page cache. Buffer address, file offset and length must be
           multiples of `ALIGN`; unaligned blocks go through per-thread
           aligned bounce buffers.
buffered   the same positional calls through the page cache, for file
           systems that refuse ``O_DIRECT``. The tier is blocking and runs
           on worker threads, so plain ``os.preadv``/``os.pwritev`` on a pool
           does what aiofiles would (aiofiles is itself a thread pool).
=========  ==============================================================

Batches of blocks run on these files through `tierkv.tiers.nvme_striped`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tierkv.device import ALIGN, GDS_INSTALL, has_cuda_driver
from tierkv.errors import ConfigError, DiskFullError, StoreUnusable
from tierkv.sizes import format_size

log = logging.getLogger(__name__)

AUTO_ORDER = ("kvikio", "odirect", "buffered")

Buffer = Any  # np.ndarray of uint8 (host) or a CUDA tensor (kvikio only)


# -- backends -------------------------------------------------------------
class BlockFile(Protocol):
    """An open ``slots.dat``. ``fd`` serves fallocate/fsync/fstat."""

    name: str
    fd: int
    needs_alignment: bool

    def pwritev(self, bufs: Sequence[Buffer], offset: int) -> None: ...
    def preadv(self, bufs: Sequence[Buffer], offset: int) -> int: ...
    def close(self) -> None: ...


def open_private(path: Path, extra_flags: int = 0) -> int:
    """Open (creating) a store file readable by this user only, whatever the umask."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | extra_flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


LOCK_WAIT_WARN_S = 10.0     # a store's lock held this long by another process is said, once a wait


def wait_flock(fd: int, mode: int, what: str) -> None:
    """Take ``fd``'s flock in ``mode`` (LOCK_SH, LOCK_EX), waiting for as long as it takes; a wait past
    ``LOCK_WAIT_WARN_S`` is logged once with the processes that hold it (a process stopped inside the store,
    by Ctrl-Z or SIGSTOP, holds its lock until it goes on or ends: every other one waited, saying nothing)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    since = time.monotonic()

    def say() -> None:
        holders = lock_holders(fd)
        log.warning("%s: waiting %.0f s for a lock another opener holds (%s); a process stopped inside the store "
                    "(Ctrl-Z, SIGSTOP) holds it until it goes on or ends", what, time.monotonic() - since,
                    f"pid {', '.join(holders)}" if holders else "which one is not known here")

    timer = threading.Timer(LOCK_WAIT_WARN_S, say)
    timer.daemon = True
    timer.start()
    try:
        fcntl.flock(fd, mode)             # (woken by the kernel as the lock is let go)
    finally:
        timer.cancel()


def lock_holders(fd: int) -> list[str]:
    """The processes /proc/locks says hold a flock on ``fd``'s file ([] where not known); this process is
    among them where another of its descriptors holds it."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = sorted({int(f[4]) for f in (line.split() for line in lines)
                   if len(f) > 5 and f[1] == "FLOCK" and f[5] == inode and f[4].isdigit()})
    return [f"{pid} (this process)" if pid == os.getpid() else str(pid) for pid in pids]


@contextlib.contextmanager
def flocked(fd: int, mode: int, what: str) -> Iterator[None]:
    """Hold ``fd``'s flock in ``mode`` (LOCK_SH, LOCK_EX) for the block (``what``: the store, for a wait)."""
    wait_flock(fd, mode, what)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new name in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BufferedFile:
    """Positional vectored I/O through the page cache."""

    name = "buffered"
    needs_alignment = False
    _flags = 0

    def __init__(self, path: Path) -> None:
        self.fd = open_private(path, self._flags)

    def pwritev(self, bufs: Sequence[Buffer], offset: int) -> None:
        views = list(bufs)
        while views:
            done = os.pwritev(self.fd, views, offset)
            if done == 0:
                raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
            offset += done
            views = _advance(views, done)

    def preadv(self, bufs: Sequence[Buffer], offset: int) -> int:
        """Bytes read; fewer than asked only at the end of the file."""
        total = os.preadv(self.fd, bufs, offset)
        if total == 0 or total == sum(map(len, bufs)):   # the end of the file, or all of it (the usual)
            return total
        views = _advance(list(bufs), total)
        while views:
            done = os.preadv(self.fd, views, offset + total)
            if done == 0:
                break
            total += done
            views = _advance(views, done)
        return total

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectFile(BufferedFile):
    """O_DIRECT: DMA straight from/to the buffers; every iovec must be aligned."""

    name = "odirect"
    needs_alignment = True
    _flags = getattr(os, "O_DIRECT", 0)

    def __init__(self, path: Path) -> None:
        if not self._flags:
            raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
        super().__init__(path)


class KvikioFile:
    """cuFile through kvikio; host (numpy) and device (CUDA tensor) buffers alike."""

    name = "kvikio"
    needs_alignment = False

    def __init__(self, path: Path) -> None:
        import kvikio  # lazy: only reached when a CUDA driver loads

        self.fd = open_private(path)
        self._file = kvikio.CuFile(path, "r+")

    def pwritev(self, bufs: Sequence[Buffer], offset: int) -> None:
        futures = []
        for buf in bufs:
            futures.append(self._file.pwrite(buf, _nbytes(buf), offset))
            offset += _nbytes(buf)
        if any(got != _nbytes(buf) for got, buf in zip(_settled(futures), bufs)):
            raise OSError(errno.EIO, "kvikio wrote fewer bytes than asked")

    def preadv(self, bufs: Sequence[Buffer], offset: int) -> int:
        futures = []
        for buf in bufs:
            futures.append(self._file.pread(buf, _nbytes(buf), offset))
            offset += _nbytes(buf)
        total, short = 0, False
        for got, buf in zip(_settled(futures), bufs):
            short = short or got < _nbytes(buf)
            total += 0 if short else got
        return total

    def close(self) -> None:
        if self.fd >= 0:
            self._file.close()
            os.close(self.fd)
            self.fd = -1


def _settled(futures: Sequence[Any]) -> list[int]:
    """Each kvikio future's byte count, every one waited for before the first error is raised: a
    buffer must not be written after its call failed (its slot may be given to another block)."""
    results: list[int] = []
    error: BaseException | None = None
    for future in futures:
        try:
            results.append(future.get())
        except BaseException as raised:      # noqa: BLE001 - raised once all are over
            error = error or raised
    if error is not None:
        raise error
    return results


BACKENDS: dict[str, Callable[[Path], BlockFile]] = {
    "kvikio": KvikioFile, "odirect": DirectFile, "buffered": BufferedFile,
}


def block_buffer(tensor: torch.Tensor | np.ndarray, block_bytes: int, backend: str) -> Buffer:
    """A flat uint8 view of ``tensor``'s ``block_bytes``, without copying (a host tier's ``buffers`` are
    such views already); a device tensor only for the kvikio backend."""
    if type(tensor) is np.ndarray:
        if tensor.dtype == np.uint8 and tensor.nbytes == block_bytes and tensor.flags.c_contiguous:
            return tensor.reshape(-1) if tensor.ndim != 1 else tensor
        raise ValueError(f"block array: {tensor.shape} {tensor.dtype}, contiguous={tensor.flags.c_contiguous}"
                         f"; expected {block_bytes} contiguous bytes")
    try:
        array = tensor.numpy()  # the common case, kept cheap: a flat uint8 CPU block
    except (TypeError, RuntimeError):
        array = None
    if array is not None and array.dtype == np.uint8 and array.nbytes == block_bytes and array.flags.c_contiguous:
        return array if array.ndim == 1 else array.reshape(-1)
    if tensor.nbytes != block_bytes or not tensor.is_contiguous():
        raise ValueError(f"block tensor: {tuple(tensor.shape)} {tensor.dtype}, contiguous="
                         f"{tensor.is_contiguous()}; expected {block_bytes} contiguous bytes")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat.numpy()
    if backend != "kvikio":
        raise ValueError(f"a {flat.device} block needs the kvikio backend (this store uses {backend})")
    return flat


def misaligned_of(tensors: Iterable[torch.Tensor | np.ndarray], needs_alignment: bool) -> set[int]:
    """Positions of the tensors O_DIRECT cannot use in place (they need a bounce buffer)."""
    if not needs_alignment:
        return set()
    return {i for i, t in enumerate(tensors)
            if (t.__array_interface__["data"][0] if type(t) is np.ndarray else t.data_ptr()) % ALIGN}


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else buf.numel() * buf.element_size()


def _advance(views: list[np.ndarray], done: int) -> list[np.ndarray]:
    """The buffers still to transfer after ``done`` bytes (flat uint8 arrays)."""
    while views and done >= len(views[0]):
        done -= len(views[0])
        views = views[1:]
    if views and done:
        views = [views[0][done:], *views[1:]]
    return views


# -- probing --------------------------------------------------------------
def probe_backend(name: str, directory: Path) -> str:
    """``"ok"`` if backend ``name`` really writes and reads a 4 KiB block in ``directory``."""
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r}: allowed: auto, {', '.join(BACKENDS)}")
    if name == "kvikio":
        if not has_cuda_driver():
            return "no CUDA driver: libcuda.so.1 does not load"
        try:
            import kvikio  # noqa: F401
        except ImportError as exc:
            return f"kvikio is not installed ({exc}); {GDS_INSTALL}"
    return _roundtrip(BACKENDS[name], Path(directory))


def probe_backends(directory: Path) -> dict[str, str]:
    """Each backend name -> ``"ok"`` or why it does not work in ``directory``."""
    return {name: probe_backend(name, directory) for name in BACKENDS}


def o_direct_supported(directory: Path) -> bool:
    return probe_backend("odirect", directory) == "ok"


def _roundtrip(opener: Callable[[Path], BlockFile], directory: Path) -> str:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tierkv-probe-", dir=directory)
    except OSError as exc:
        return f"cannot create a file in {directory}: {exc.strerror or exc}"
    os.close(fd)
    out, back = np.frombuffer(mmap.mmap(-1, ALIGN), np.uint8), np.frombuffer(mmap.mmap(-1, ALIGN), np.uint8)
    out[:] = np.arange(ALIGN) % 251
    try:
        file = opener(Path(tmp))
        try:
            file.pwritev([out], 0)
            got = file.preadv([back], 0)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return "ok"  # the mode was accepted; a full disk is not the backend's fault
            raise
        finally:
            file.close()
        if got != ALIGN or not np.array_equal(out, back):
            return f"read back {got} of {ALIGN} bytes, or different bytes"
        return "ok"
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"the file system refuses this I/O mode (EINVAL: {exc.strerror})"
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # kvikio raises its own RuntimeErrors
        return f"{type(exc).__name__}: {exc}"
    finally:
        os.unlink(tmp)


def choose_backend(requested: str, directory: Path, block_bytes: int) -> str:
    """The backend to use; ConfigError if an explicit one (or every one) fails its probe."""
    if requested != "auto" and requested not in BACKENDS:
        raise ConfigError(f"backend={requested!r}: allowed: auto, {', '.join(BACKENDS)}")
    reasons: dict[str, str] = {}
    for name in AUTO_ORDER if requested == "auto" else (requested,):
        reason = probe_backend(name, directory)
        if reason == "ok" and name == "odirect" and block_bytes % ALIGN:
            reason = f"block_bytes={block_bytes} is not a multiple of {ALIGN}"
        if reason == "ok":
            return name
        reasons[name] = reason
    if requested == "auto":
        raise ConfigError(f"no NVMe backend works in {directory}: {reasons}")
    raise ConfigError(f"backend={requested!r} does not work in {directory}: {reasons[requested]}")


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def store_errors_named(directory: Path) -> Iterator[None]:
    """A store that this user may not use, or on a read-only file system, said so (not a bare errno)."""
    try:
        yield
    except PermissionError as exc:
        raise StoreUnusable(f"NVMe store {directory}: no permission for {exc.filename} ({exc.strerror}); "
                            f"the store must belong to this user (it is created 0700, files 0600): "
                            f"fix its owner or mode, or use another directory") from None
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        raise StoreUnusable(f"NVMe store {directory}: cannot write {exc.filename} ({exc.strerror}); every process "
                            f"that opens a store writes to it (tierkv store verify reads one without writing): "
                            f"give a writable directory") from None


@contextlib.contextmanager
def disk_full_raised(directory: Path, needed: int) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT from the block into DiskFullError, naming the ``needed`` bytes."""
    try:
        yield
    except OSError as exc:
        if exc.errno in DISK_FULL and not isinstance(exc, DiskFullError):
            raise disk_full(directory, needed) from exc
        raise


def disk_full(directory: Path, needed: int, *, what: str = "", why: str = "") -> DiskFullError:
    """``what``: the file that did not fit, where it is not a block; ``why``: what else to say of it."""
    fs = os.statvfs(directory)
    return DiskFullError(errno.ENOSPC, f"NVMe store {directory}: no space left for "
                         f"{what + ' of ' if what else ''}{format_size(needed)} ({needed} bytes) more; "
                         f"{format_size(fs.f_bavail * fs.f_frsize)} free. Free disk space or lower the NVMe budget"
                         f"{why}")
