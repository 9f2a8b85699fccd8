"""Block I/O for the NVMe tier: three backends and a striped thread pool.

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

`StripedIO` runs one batch: it sorts the blocks by slot, coalesces adjacent
slots into one vectored call per run, and spreads the runs over its threads
(the calling thread works through the runs alongside the pool's helpers)::

    slots   3 4 5 6   9 10   20         threads = 2, max run = ceil(7/2) = 4
    runs    [3 4 5 6] [9 10] [20]  ->  pwritev(fd, [b3,b4,b5,b6], 3*block_bytes) ...

Checksums are xxh3_64 of each block's bytes, computed on the worker thread
from a zero-copy numpy view of the caller's tensor (without holding the GIL).
"""
from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from tierkv.device import ALIGN, has_cuda_driver
from tierkv.errors import ConfigError

log = logging.getLogger(__name__)

AUTO_ORDER = ("kvikio", "odirect", "buffered")
MAX_RUN_BYTES = 8 * 1024**2
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024

Buffer = Any  # np.ndarray of uint8 (host) or a CUDA tensor (kvikio only)


def checksum(block: Buffer) -> int:
    """xxh3_64 of the block. The hasher object, unlike the one-shot ``xxh3_64_intdigest``,
    releases the GIL for inputs over 64 KiB, so workers hash while others issue I/O."""
    return xxhash.xxh3_64(block).intdigest()


# -- alignment --------------------------------------------------------------
def is_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % ALIGN == 0 and array.nbytes % ALIGN == 0


# -- backends -------------------------------------------------------------
class BlockFile(Protocol):
    """An open ``slots.dat``. ``fd`` serves fallocate/fsync/fstat."""

    name: str
    fd: int
    needs_alignment: bool

    def pwritev(self, bufs: Sequence[Buffer], offset: int) -> None: ...
    def preadv(self, bufs: Sequence[Buffer], offset: int) -> int: ...
    def close(self) -> None: ...


def _open_private(path: Path, extra_flags: int = 0) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | extra_flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class BufferedFile:
    """Positional vectored I/O through the page cache."""

    name = "buffered"
    needs_alignment = False
    _flags = 0

    def __init__(self, path: Path) -> None:
        self.fd = _open_private(path, self._flags)

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
        views = list(bufs)
        total = 0
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

        self.fd = _open_private(path)
        self._file = kvikio.CuFile(path, "r+")

    def pwritev(self, bufs: Sequence[Buffer], offset: int) -> None:
        futures = []
        for buf in bufs:
            futures.append((self._file.pwrite(buf, _nbytes(buf), offset), _nbytes(buf)))
            offset += _nbytes(buf)
        for future, size in futures:
            if future.get() != size:
                raise OSError(errno.EIO, "kvikio wrote fewer bytes than asked")

    def preadv(self, bufs: Sequence[Buffer], offset: int) -> int:
        futures = []
        for buf in bufs:
            futures.append(self._file.pread(buf, _nbytes(buf), offset))
            offset += _nbytes(buf)
        total, short = 0, False
        for future, buf in zip(futures, bufs):
            got = future.get()
            short = short or got < _nbytes(buf)
            total += 0 if short else got
        return total

    def close(self) -> None:
        if self.fd >= 0:
            self._file.close()
            os.close(self.fd)
            self.fd = -1


BACKENDS: dict[str, Callable[[Path], BlockFile]] = {
    "kvikio": KvikioFile, "odirect": DirectFile, "buffered": BufferedFile,
}


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
            return f"kvikio is not installed ({exc}); pip install 'tierkv[gds]'"
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


# -- striped batches ------------------------------------------------------
def plan_runs(slots: Sequence[int], max_blocks: int) -> list[tuple[int, int]]:
    """Split ascending ``slots`` into ``[lo, hi)`` runs of adjacent slots, at most ``max_blocks`` long."""
    runs: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - lo == max_blocks:
            runs.append((lo, i))
            lo = i
    return runs


@dataclass(slots=True)
class Batch:
    """One call's blocks, shared by the workers; ``sums[i]`` is filled for block i."""

    slots: Sequence[int]
    bufs: Sequence[Buffer]
    misaligned: Collection[int] | None
    sums: list


class StripedIO:
    """Reads and writes batches of whole blocks on ``threads`` workers."""

    def __init__(self, file: BlockFile, block_bytes: int, threads: int) -> None:
        self.file = file
        self.block_bytes = block_bytes
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, "tierkv-nvme") if threads > 1 else None
        self._local = threading.local()
        self._max_run = max(1, min(IOV_MAX, MAX_RUN_BYTES // block_bytes))

    def write(self, slots: Sequence[int], bufs: Sequence[Buffer],
              misaligned: Collection[int] | None = None) -> list[int]:
        """Write every block; their checksums in input order. Raises the first I/O error.

        ``misaligned``: indices of buffers not on an `ALIGN` boundary, when the caller
        knows them cheaply (``tensor.data_ptr()``); None makes the workers check.
        """
        batch = Batch(slots, bufs, misaligned, [0] * len(slots))
        self._run_batch(self._write_run, batch)
        return batch.sums

    def read(self, slots: Sequence[int], bufs: Sequence[Buffer],
             misaligned: Collection[int] | None = None) -> list[int | None]:
        """Read every block; checksum per block, None where it could not be read whole."""
        batch = Batch(slots, bufs, misaligned, [None] * len(slots))
        self._run_batch(self._read_run, batch)
        return batch.sums

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- internals ---------------------------------------------------------
    def _run_batch(self, work: Callable[[list[int], Batch], None], batch: Batch) -> None:
        """Run ``work`` over the batch's runs on the calling thread and up to threads-1 helpers."""
        slots = batch.slots
        order = sorted(range(len(slots)), key=slots.__getitem__)
        max_blocks = min(self._max_run, math.ceil(len(slots) / self.threads))
        runs = [order[lo:hi] for lo, hi in plan_runs([slots[i] for i in order], max_blocks)]
        pending = iter(runs)
        take = threading.Lock()
        errors: list[BaseException] = []

        def drain() -> None:
            while not errors:
                with take:
                    run = next(pending, None)
                if run is None:
                    return
                try:
                    work(run, batch)
                except BaseException as exc:  # noqa: BLE001 - re-raised below, after all helpers stop
                    errors.append(exc)

        helpers = min(self.threads, len(runs)) - 1
        futures = [self._pool.submit(drain) for _ in range(helpers)] if self._pool else []
        drain()
        for future in futures:  # they still use the caller's buffers: wait for every one
            future.result()
        if errors:
            raise errors[0]

    def _write_run(self, run: list[int], batch: Batch) -> None:
        blocks = [batch.bufs[i] for i in run]
        for i, block in zip(run, blocks):
            batch.sums[i] = checksum(_host(block))
        iov, bounced = self._iovecs(run, blocks, batch)
        for k in bounced:
            iov[k][:] = blocks[k]
        self.file.pwritev(iov, batch.slots[run[0]] * self.block_bytes)

    def _read_run(self, run: list[int], batch: Batch) -> None:
        blocks = [batch.bufs[i] for i in run]
        iov, bounced = self._iovecs(run, blocks, batch)
        offset = batch.slots[run[0]] * self.block_bytes
        try:
            whole = self.file.preadv(iov, offset) // self.block_bytes
        except OSError as exc:
            log.warning("read of %d block(s) at offset %d failed: %s", len(run), offset, exc)
            return
        for k in bounced:
            if k < whole:
                blocks[k][:] = iov[k]
        for k in range(whole):
            batch.sums[run[k]] = checksum(_host(blocks[k]))

    def _iovecs(self, run: list[int], blocks: list[Buffer], batch: Batch) -> tuple[list[Buffer], list[int]]:
        """The buffers to hand the kernel, and which positions of the run are bounce buffers."""
        if not self.file.needs_alignment:
            return blocks, []
        if batch.misaligned is None:
            bounced = [k for k, b in enumerate(blocks) if not is_aligned(b)]
        else:
            bounced = [k for k, i in enumerate(run) if i in batch.misaligned]
        if not bounced:
            return blocks, []
        bounce = self._bounce(len(bounced))
        iov = list(blocks)
        for j, k in enumerate(bounced):
            iov[k] = bounce[j * self.block_bytes:(j + 1) * self.block_bytes]
        return iov, bounced

    def _bounce(self, nblocks: int) -> np.ndarray:
        """This thread's aligned scratch buffer of at least ``nblocks`` blocks."""
        buf: np.ndarray | None = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < nblocks * self.block_bytes:
            buf = np.frombuffer(mmap.mmap(-1, nblocks * self.block_bytes), np.uint8)  # page-aligned
            self._local.bounce = buf
        return buf


def _host(block: Buffer) -> np.ndarray:
    """Host bytes to checksum: the block itself, or a copy of a CUDA block (kvikio)."""
    return block if isinstance(block, np.ndarray) else block.cpu().numpy()
