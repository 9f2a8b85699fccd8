"""Batches of whole blocks on the NVMe block file: persistent workers, checksums off the I/O path.

Reads of an O_DIRECT file skip the workers where the kernel allows native AIO: the calling
thread submits the whole batch and verifies blocks as they land (`tierkv.tiers.nvme_aio`). What
follows is how the workers write, and read for the other backends and bounce-buffered batches.

A batch is sorted by slot and cut into runs of adjacent slots, one vectored
call each, at most `MAX_RUN_BYTES`. The runs are dealt in order into about
`WRITE_TASKS_PER_THREAD` (`READ_TASKS_PER_THREAD`) tasks per worker; a worker
claims a task at a time::

    slots   3 4 5 6   9 10   20         threads = 2: at most ceil(7 / (2 * 2)) = 2 blocks a run
    runs    [3 4] [5 6] [9 10] [20]  ->  pwritev(fd, [b3, b4], 3 * block_bytes) ...
    tasks   one run each here; 200 scattered pages (sparse decode), 4 workers: 8 tasks of 25 one-page runs

A call's tasks form a `Job`. The ``threads`` workers live as long as the store
and take jobs from one queue; each claims the next task of its job as soon as
it is free, so the device gets the runs back to back. A task, not a run, is
what costs a claim, a hand-off to the caller and a wake-up: ~15 us of CPU per
12 KiB page when every scattered page was its own task. The calling thread
takes the checksums meanwhile, so no worker waits for a hash before its next call::

    write, 4 workers, 8 tasks
      worker k  | pwritev task k | pwritev task k+4 |     (k = 0..3; the next free worker takes the next task)
      caller    submit | wait: 4 tasks claimed | hash every block | wait for all tasks |
                then tierkv.tiers.nvme appends the journal records carrying the sums
    read, 4 workers, 8 tasks
      worker k  | preadv task k | preadv task k+4, verify it |
      caller    submit | task 0 back: verify it | task 1 back: verify it | ... | wait for all tasks
                (tasks 4..7, the last wave, are verified by their own workers: nothing is left to read)

Jobs queue by priority (`JobQueue`): a read that a caller waits for (`URGENT`)
goes before a guessed prefetch (`BACKGROUND`) and a write-back (`LAST`). Sparse
decode reads 12 KiB pages at random, 15-40K a second on the disk here, so a
demand read queued behind a 400-page prefetch would wait 10-30 ms for it.
Instead, a worker about to start a run checks for a more urgent job and serves
it first, then goes on with its task::

    worker    | guess run 0 | guess run 1 | wanted 0 | wanted 1 | guess run 2 | ...
                                  ^ a caller's read queued here

Checksums are xxh3_64 of a block's bytes, taken from a zero-copy numpy view of
the caller's tensor; the hasher releases the GIL for inputs over 64 KiB.
Hashing a block while it is being written is safe: the caller's bytes do not
change during the call, and the sums go only into journal records appended
after `Job.wait`. A read block counts only once its hash is taken. After an
error a job skips the tasks not yet started, but every task is reported, so once
`Job.wait` returns (or raises the first error) no worker touches the caller's
buffers.
"""
from __future__ import annotations

import errno
import functools
import heapq
import itertools
import logging
import math
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from tierkv.device import ALIGN
from tierkv.tiers import nvme_aio
from tierkv.tiers.nvme_io import BlockFile, Buffer

log = logging.getLogger(__name__)

MAX_RUN_BYTES = 8 * 1024**2
URGENT, BACKGROUND, LAST = 0, 1, 2   # job priorities: a caller waits / a guess ahead of need / write-back
UNREADABLE = -1     # a block's checksum where the device answered its read with an error (short: None)
# Tasks per worker and call. Each task costs a hand-off: 256 KiB blocks took ~10 % more CPU per GB at 4
# than at 1 (measured). At 2, reads gained ~5 % (the caller verifies the first wave while the second is
# read) and writes kept ~3 of 4 requests in flight instead of ~2.2 (a worker that finishes early takes
# more), for ~0.01 s/GB more CPU.
WRITE_TASKS_PER_THREAD = 2
READ_TASKS_PER_THREAD = 2
# Native reads in flight at once per call: a read a caller waits for puts its whole batch before the
# device; a guess or a write-back's read a few at a time, so a caller's read queues behind few of them.
NATIVE_DEPTH = {URGENT: nvme_aio.MAX_DEPTH, BACKGROUND: 32, LAST: 16}
# a refusal for want of room (the system's AIO requests, fs.aio-max-nr, used up by other processes for
# now): reads go to the workers this long, then native again; any other refusal is for good
NATIVE_PAUSE_S = 5.0
NATIVE_BUSY = (errno.EAGAIN, errno.ENOMEM)
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024


def checksum(block: Buffer) -> int:
    """xxh3_64 of the block. The hasher object, unlike the one-shot ``xxh3_64_intdigest``,
    releases the GIL for inputs over 64 KiB, so it runs beside the workers' I/O."""
    return xxhash.xxh3_64(block).intdigest()


def is_aligned(array: np.ndarray) -> bool:
    return array.ctypes.data % ALIGN == 0 and array.nbytes % ALIGN == 0


def plan_runs(slots: Sequence[int] | np.ndarray, max_blocks: int) -> list[tuple[int, int]]:
    """Split ascending ``slots`` into ``[lo, hi)`` runs of adjacent slots, at most ``max_blocks`` long
    (in array passes: a sparse read's hundreds of scattered pages are as many runs)."""
    at = np.asarray(slots, np.int64)
    if not len(at):
        return []
    breaks = np.flatnonzero(np.diff(at) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(at)]])
    pieces = -(-(ends - starts) // max_blocks)              # a run longer than max_blocks is cut
    first = np.repeat(starts, pieces)
    nth = np.arange(len(first)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    lo = first + nth * max_blocks
    hi = np.minimum(lo + max_blocks, np.repeat(ends, pieces))
    return list(zip(lo.tolist(), hi.tolist()))


def plan_tasks(runs: list[Run], count: int) -> list[Task]:
    """Deal ``runs`` in order into ``count`` tasks (fewer if there are fewer runs), as even as can be."""
    count = min(count, len(runs))
    if not count:
        return []
    cuts = [len(runs) * i // count for i in range(count + 1)]
    return [runs[lo:hi] for lo, hi in zip(cuts, cuts[1:])]


@dataclass(slots=True)
class Batch:
    """One call's blocks, shared by the workers; ``sums[i]`` is filled for block i."""

    slots: Sequence[int]
    bufs: Sequence[Buffer]
    misaligned: Collection[int] | None
    sums: list
    addresses: np.ndarray | None = None   # each host buffer's address, where the caller knows them

    def hash_blocks(self, indices: Iterable[int]) -> None:
        for i in indices:
            self.sums[i] = checksum(_host(self.bufs[i]))


Run = list[int]      # positions in a batch of blocks on adjacent slots: one vectored call
Task = list[Run]     # what a worker claims at a time
Pause = Callable[[], None]                       # called between runs: serve more urgent jobs first
Work = Callable[[Task, Batch, bool, Pause], object]


class Job:
    """One call's tasks, shared by the workers it was handed to.

    Workers claim tasks in slot order until none is left and report every task,
    skipped (after an error) and failed ones too, so once `wait` returns no
    worker touches the call's buffers. Tasks from ``tail`` on are the last wave:
    their own workers verify them, having nothing left to read.
    """

    __slots__ = ("work", "batch", "tasks", "tail", "priority", "error", "_started", "_wave", "_claimed", "_claim",
                 "_pending", "_done")

    def __init__(self, work: Work, batch: Batch, tasks: list[Task], *, tail: int, wave: int,
                 priority: int = URGENT) -> None:
        self.work, self.batch, self.tasks, self.tail, self.priority = work, batch, tasks, tail, priority
        self.error: BaseException | None = None
        self._started = threading.Event()  # set once the first ``wave`` tasks are claimed
        self._wave, self._claimed, self._claim = wave, 0, threading.Lock()
        if wave == 0:  # an empty batch
            self._started.set()
        self._pending = len(tasks)
        self._done: queue.SimpleQueue[tuple[int, object]] = queue.SimpleQueue()

    def do_tasks(self, yield_to: Callable[[int], None] = lambda priority: None) -> None:
        """On a worker: do unclaimed tasks until there are none. Between two runs the worker calls
        ``yield_to(priority)``, which serves any job more urgent than this one first."""
        pause = functools.partial(yield_to, self.priority)
        while True:
            with self._claim:
                index, self._claimed = self._claimed, self._claimed + 1
            if index + 1 == self._wave:
                self._started.set()
            if index >= len(self.tasks):
                return
            result: object = None   # a task skipped or failed: nothing of it is whole
            if self.error is None:
                try:
                    result = self.work(self.tasks[index], self.batch, index >= self.tail, pause)
                except BaseException as exc:  # noqa: BLE001 - raised on the caller by wait()
                    self.error = self.error or exc
            self._done.put((index, result))

    def checksums(self) -> list[int]:
        """Hash every block on the calling thread, once the workers are under way; stops if the job fails.

        Hashing right away would compete with the workers' start for the CPU and the GIL.
        """
        self._started.wait()
        sums = self.batch.sums
        for i, buf in enumerate(self.batch.bufs):
            if self.error is not None:
                break
            sums[i] = checksum(_host(buf))
        return sums

    def completions(self) -> Iterator[tuple[int, object]]:
        """``(task index, result)`` as tasks complete; for the submitting thread only."""
        while self._pending:
            self._pending -= 1
            yield self._done.get()

    def wait(self) -> None:
        """Wait for every task still out; raise the first error a worker hit."""
        for _ in self.completions():
            pass
        if self.error is not None:
            raise self.error


class JobQueue:
    """The jobs the workers serve, most urgent first (lower ``priority``), then in order of arrival.

    A job is queued once per worker it may keep busy. A worker that finishes a run of a job
    while a more urgent one waits serves that one first (`take_more_urgent`), then goes on,
    so a read that a caller waits for overtakes a prefetch under way after at most one run.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Job | None]] = []
        self._ready = threading.Condition()
        self._arrival = itertools.count()

    def put(self, job: Job | None, copies: int = 1) -> None:
        """Queue ``job`` ``copies`` times; None stops one worker, after every job queued before it."""
        priority = math.inf if job is None else job.priority
        with self._ready:
            for _ in range(copies):
                heapq.heappush(self._heap, (priority, next(self._arrival), job))
            self._ready.notify(copies)

    def get(self) -> Job | None:
        with self._ready:
            while not self._heap:
                self._ready.wait()
            return heapq.heappop(self._heap)[2]

    def more_urgent(self, priority: int) -> bool:
        """Whether a job more urgent than ``priority`` waits (a racy peek; a miss costs one run)."""
        heap = self._heap
        return bool(heap) and heap[0][0] < priority

    def take_more_urgent(self, priority: int) -> Job | None:
        """The most urgent job if it is more urgent than ``priority``; None (at once) if none is."""
        with self._ready:
            heap = self._heap
            return heapq.heappop(heap)[2] if heap and heap[0][0] < priority else None


class StripedIO:
    """Reads and writes batches of whole blocks on ``threads`` persistent workers."""

    def __init__(self, file: BlockFile, block_bytes: int, threads: int, *, native_reads: bool = False) -> None:
        self.file = file
        self.block_bytes = block_bytes
        self.threads = threads
        # reads by native AIO on the calling thread (tierkv.tiers.nvme_aio): O_DIRECT files only
        self.native_reads = (native_reads and file.name == "odirect" and block_bytes % ALIGN == 0
                             and nvme_aio.available())
        self._native_from = 0.0            # (monotonic) native reads paused until then after a busy refusal
        self._max_run = max(1, min(IOV_MAX, MAX_RUN_BYTES // block_bytes))
        self._queue = JobQueue()
        self._local = threading.local()
        self._workers = [threading.Thread(target=self._serve, name=f"tierkv-nvme-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def start_write(self, slots: Sequence[int], bufs: Sequence[Buffer],
                    misaligned: Collection[int] | None = None, *, priority: int = URGENT) -> Job:
        """Queue a batch's writes and return; the caller then takes `Job.checksums` and must `Job.wait`.

        ``misaligned``: indices of buffers not on an `ALIGN` boundary, when the caller
        knows them cheaply (``tensor.data_ptr()``); None makes the workers check.
        The buffers must stay alive and unchanged until `Job.wait` returns.
        ``priority``: lower goes first (`URGENT`, `BACKGROUND`, ...; see `JobQueue`).
        """
        batch = Batch(slots, bufs, misaligned, [0] * len(slots))
        return self._submit(self._write_task, batch, WRITE_TASKS_PER_THREAD, verify_tail=False, priority=priority)

    def write(self, slots: Sequence[int], bufs: Sequence[Buffer],
              misaligned: Collection[int] | None = None, *, priority: int = URGENT) -> list[int]:
        """Write every block; their checksums in input order. Raises the first I/O error."""
        job = self.start_write(slots, bufs, misaligned, priority=priority)
        try:
            return job.checksums()
        finally:
            job.wait()

    def read(self, slots: Sequence[int], bufs: Sequence[Buffer],
             misaligned: Collection[int] | None = None, *, priority: int = URGENT,
             addresses: np.ndarray | None = None) -> list[int | None]:
        """Read every block; checksum per block, None where it came back short, ``UNREADABLE`` where the
        device answered with an error. ``addresses``: where each of ``bufs`` (host arrays) starts, where
        the caller knows it without asking each."""
        batch = Batch(slots, bufs, misaligned, [None] * len(slots), addresses)
        if self.native_reads and self._native_from <= time.monotonic() and self._read_native(batch, priority):
            return batch.sums
        job = self._submit(self._read_task, batch, READ_TASKS_PER_THREAD, verify_tail=True, priority=priority)
        try:  # verify task k while the workers read the tasks after it
            for index, whole_blocks in job.completions():
                if index < job.tail and whole_blocks:
                    batch.hash_blocks(whole_blocks)
        finally:
            job.wait()
        return batch.sums

    def close(self) -> None:
        """Stop the workers (after the jobs already queued)."""
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join()
        self._workers.clear()

    # -- internals ---------------------------------------------------------
    def _submit(self, work: Work, batch: Batch, tasks_per_thread: int, *, verify_tail: bool,
                priority: int) -> Job:
        """Queue the batch as tasks of runs in slot order, about ``tasks_per_thread`` for each worker."""
        slots = np.asarray(batch.slots, np.int64)
        ranked = np.argsort(slots, kind="stable")
        max_blocks = min(self._max_run, math.ceil(len(slots) / (self.threads * tasks_per_thread)))
        order = ranked.tolist()
        runs = [order[lo:hi] for lo, hi in plan_runs(slots[ranked], max_blocks)]
        tasks = plan_tasks(runs, self.threads * tasks_per_thread)
        wave = min(self.threads, len(tasks))
        job = Job(work, batch, tasks, tail=len(tasks) - self.threads if verify_tail else len(tasks), wave=wave,
                  priority=priority)
        self._queue.put(job, wave)
        return job

    def _serve(self) -> None:
        """A worker: work on queued jobs, the most urgent first, until the None sentinel."""
        while (job := self._queue.get()) is not None:
            job.do_tasks(self._yield_to)

    def _yield_to(self, priority: int) -> None:
        """Between two runs of a job of ``priority``: serve every job more urgent than it first."""
        while self._queue.more_urgent(priority) and (job := self._queue.take_more_urgent(priority)):
            job.do_tasks(self._yield_to)

    def _read_native(self, batch: Batch, priority: int) -> bool:
        """Read ``batch`` by native AIO, verifying blocks as they land; False where its buffers need
        the workers (a bounce buffer, device memory) or the kernel refused it."""
        if batch.misaligned:
            return False
        addresses = batch.addresses
        try:
            if addresses is None:   # (``__array_interface__``: a third of ``.ctypes.data``'s cost a buffer)
                addresses = np.fromiter((buf.__array_interface__["data"][0] for buf in batch.bufs), np.uint64,
                                        len(batch.bufs))
        except AttributeError:   # device buffers
            return False
        if batch.misaligned is None and (addresses % ALIGN).any():
            return False
        try:
            results = nvme_aio.read_blocks(self.file.fd, np.asarray(batch.slots, np.int64), addresses,
                                           self.block_bytes, batch.hash_blocks, depth=NATIVE_DEPTH[priority])
            for i in np.flatnonzero(results < 0).tolist():
                batch.sums[i] = UNREADABLE
        except nvme_aio.AioRefused as exc:
            if exc.errno in NATIVE_BUSY:
                log.info("native AIO refused a read (%s): worker threads read for the next %.0f s", exc,
                         NATIVE_PAUSE_S)
                self._native_from = time.monotonic() + NATIVE_PAUSE_S
            else:
                log.warning("native AIO refused a read (%s): this store reads on its worker threads from now on",
                            exc)
                self.native_reads = False
            if exc.results is None:
                return False
            rest = np.flatnonzero(exc.results != self.block_bytes).tolist() + \
                list(range(len(exc.results), len(batch.slots)))      # what did not land: read on the workers
            sums = self.read([batch.slots[i] for i in rest], [batch.bufs[i] for i in rest], set(), priority=priority)
            for i, value in zip(rest, sums):
                batch.sums[i] = value
        return True

    def _write_task(self, task: Task, batch: Batch, _verify: bool, pause: Pause) -> int:
        for run in task:
            pause()
            blocks = [batch.bufs[i] for i in run]
            iov, bounced = self._iovecs(run, blocks, batch)
            for k in bounced:
                iov[k][:] = blocks[k]
            self.file.pwritev(iov, batch.slots[run[0]] * self.block_bytes)
        return sum(map(len, task))

    def _read_task(self, task: Task, batch: Batch, verify: bool, pause: Pause) -> list[int]:
        """Read the task's runs; the blocks that came back whole (verified too if ``verify``)."""
        whole_blocks: list[int] = []
        for run in task:
            pause()
            blocks = [batch.bufs[i] for i in run]
            iov, bounced = self._iovecs(run, blocks, batch)
            offset = batch.slots[run[0]] * self.block_bytes
            try:
                whole = self.file.preadv(iov, offset) // self.block_bytes
            except OSError as exc:
                log.warning("read of %d block(s) at offset %d failed: %s", len(run), offset, exc)
                for i in run:
                    batch.sums[i] = UNREADABLE
                continue
            for k in bounced:
                if k < whole:
                    blocks[k][:] = iov[k]
            whole_blocks += run[:whole] if whole < len(run) else run
        if verify:
            batch.hash_blocks(whole_blocks)
        return whole_blocks

    def _iovecs(self, run: list[int], blocks: list[Buffer], batch: Batch) -> tuple[list[Buffer], list[int]]:
        """The buffers to hand the kernel, and which positions of the run are bounce buffers."""
        if not self.file.needs_alignment or batch.misaligned is not None and not batch.misaligned:
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
