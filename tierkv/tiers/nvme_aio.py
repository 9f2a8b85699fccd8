"""Linux native AIO for the NVMe tier's reads: a batch of blocks in a few system calls, no thread a request.

A sparse decode step reads hundreds of 12 KiB pages at random. On worker
threads each page costs a Python call, a hand-off and a turn at the
interpreter's lock (~7 us of Python a page beside the system call). Here a
batch's requests are built in numpy arrays, handed to the kernel with one
``io_submit``, and the calling thread takes the completions with
``io_getevents``, checksumming each block as it lands::

    caller  | iocbs (numpy) | io_submit | io_getevents: verify what landed, submit more | ... | all reaped
    device  |               |  up to ``depth`` requests in flight                            |

Only O_DIRECT files are read this way: on a buffered file ``io_submit`` would
do the read itself, synchronously. The calls go through ``syscall(2)`` by
number (what libaio's wrappers are); where the kernel refuses them (a seccomp
filter, a kernel without AIO) `available` is false and the store keeps its
worker threads. A completion belongs to whoever reaps it, so each thread has
its own context, made on first use and destroyed with the thread (or at once,
by a batch interrupted part-way: the thread's next batch makes a new one).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

MAX_DEPTH = 512   # requests a thread's context holds in flight
# io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD = 0
IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"), ("reqprio", "<i2"),
                 ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"), ("reserved2", "<u8"),
                 ("flags", "<u4"), ("resfd", "<u4")])      # struct iocb, 64 bytes
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])   # struct io_event

_numbers = _SYSCALLS.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True) if _numbers and os.name == "posix" else None
if _libc is not None:
    _libc.syscall.restype = ctypes.c_long


class AioRefused(OSError):
    """The kernel refused a batch's requests: read them another way. ``results``: what the requests
    submitted before the refusal did (as `read_blocks` returns; None: none was submitted)."""

    results: np.ndarray | None = None


def _call(number: int, *args: object) -> int:
    """``syscall(number, *args)``; ``-errno`` on failure (ctypes releases the GIL meanwhile)."""
    result = _libc.syscall(ctypes.c_long(number), *args)
    return -ctypes.get_errno() if result < 0 else result


class _Context:
    """One thread's AIO context (``aio_context_t``), destroyed when the thread's locals go."""

    handle = 0

    def __init__(self) -> None:
        handle = ctypes.c_ulong(0)
        result = _call(_numbers[0], ctypes.c_long(MAX_DEPTH), ctypes.byref(handle))
        if result < 0:   # (EAGAIN: the system's aio-max-nr is taken; ENOSYS, EPERM: no AIO here)
            raise AioRefused(-result, f"io_setup: {os.strerror(-result)}")
        self.handle = handle.value

    def destroy(self) -> None:
        """``io_destroy``: returns once every request in flight is over, whatever was reaped of them."""
        if _libc is not None and self.handle:
            handle, self.handle = self.handle, 0
            _call(_numbers[1], ctypes.c_ulong(handle))

    def __del__(self) -> None:
        self.destroy()


_local = threading.local()
_probed: bool | None = None
_probe_lock = threading.Lock()


def available() -> bool:
    """Whether this process may use native AIO (probed once: an ``io_setup`` that the kernel allows)."""
    global _probed
    with _probe_lock:
        if _probed is None:
            try:
                _probed = _libc is not None and _context() is not None
            except OSError as exc:
                log.info("native AIO unavailable (%s): the NVMe tier reads on worker threads", exc)
                _probed = False
        return _probed


def _context() -> _Context:
    context = getattr(_local, "context", None)
    if context is None:
        context = _local.context = _Context()
    return context


def read_blocks(fd: int, slots: np.ndarray, addresses: np.ndarray, block_bytes: int,
                landed: Callable[[list[int]], None], *, depth: int = MAX_DEPTH) -> np.ndarray:
    """Read block i of the batch from slot ``slots[i]`` of ``fd`` into ``addresses[i]``, at most
    ``depth`` requests in flight; ``landed(indices)`` is called on this thread with the blocks that
    came back whole, as they do. Returns each block's result: ``block_bytes``, fewer (a short read)
    or ``-errno``.

    Raises `AioRefused` if the kernel refuses a request (with ``results`` of those before it), and
    whatever ``landed`` raises; either way every request submitted is over first (reaped, or waited
    for as this thread's context is destroyed), so no read lands in a buffer after this returns.
    """
    n = len(slots)
    results = np.full(n, -errno.ECANCELED, np.int64)
    if not n:
        return results
    depth = max(1, min(depth, MAX_DEPTH))
    iocbs = np.zeros(n, IOCB)
    iocbs["data"] = np.arange(n, dtype=np.uint64)
    iocbs["opcode"] = _IOCB_CMD_PREAD
    iocbs["fildes"] = fd
    iocbs["buf"] = addresses
    iocbs["nbytes"] = block_bytes
    iocbs["offset"] = np.asarray(slots, np.int64) * block_bytes
    pointers = np.uint64(iocbs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(IOCB.itemsize)
    events = np.zeros(min(n, depth), EVENT)
    context = _context()
    handle = ctypes.c_ulong(context.handle)
    submitted = reaped = 0
    refused = 0   # errno of a submit the kernel refused: the rest of the batch is not submitted
    try:
        while reaped < n:
            room = min(depth - (submitted - reaped), n - submitted)
            if room > 0 and not refused:
                got = _call(_numbers[3], handle, ctypes.c_long(room),
                            ctypes.c_void_p(int(pointers.ctypes.data) + submitted * 8))
                if got > 0:
                    submitted += got
                elif got == -errno.EAGAIN and submitted > reaped or got == -errno.EINTR:
                    pass   # no room until some complete / interrupted: try again after the next reap
                else:
                    refused = -got
            if submitted == reaped:
                if refused:
                    break
                continue   # interrupted before anything was in flight
            got = _reap(handle, events, submitted - reaped)
            if got == -errno.EINTR:
                continue
            done = events[:got]
            index, result = done["data"].astype(np.int64), done["res"]
            results[index] = result
            reaped += got
            whole = index[result == block_bytes]
            if len(whole):
                landed(whole.tolist())
    except BaseException:
        # raised between a call and its count (an interrupt, a failed reap), ``submitted - reaped`` may
        # be wrong: the context goes, waiting for all it holds, so that no read lands in a buffer after
        # this returns and no stale completion is taken for a later batch's
        _local.context = None
        context.destroy()
        raise
    if refused:
        what = f"{n} reads" if not submitted else f"the last {n - submitted} of {n} reads"
        exc = AioRefused(refused, f"io_submit of {what}: {os.strerror(refused)}")
        exc.results = results[:submitted] if submitted else None
        raise exc
    bad = np.flatnonzero(results != block_bytes)
    if len(bad):
        first = int(bad[0])
        log.warning("%d of %d block read(s) failed, the first at offset %d: %s", len(bad), n,
                    int(slots[first]) * block_bytes, _describe(int(results[first]), block_bytes))
    return results


def _reap(handle: ctypes.c_ulong, events: np.ndarray, outstanding: int) -> int:
    """Wait for at least one of ``outstanding`` requests; how many completions ``events`` now holds
    (``-EINTR``: interrupted, none)."""
    got = _call(_numbers[2], handle, ctypes.c_long(1), ctypes.c_long(min(len(events), outstanding)),
                ctypes.c_void_p(events.ctypes.data), None)
    if got < 0 and got != -errno.EINTR:
        raise OSError(-got, f"io_getevents with {outstanding} read(s) in flight: {os.strerror(-got)}")
    return got


def _describe(result: int, block_bytes: int) -> str:
    if result < 0:
        return os.strerror(-result)
    return f"short read ({result} of {block_bytes} bytes)"
