"""Runs transfers on worker threads in priority order, with bounded bytes in flight.

The queue is a heap of (priority, sequence): a load a caller waits for beats
a prefetch, which beats a write-back; equal priorities run in submit order.
A job starts when a worker is free and the bytes in flight plus its own stay
under the limit (one job always may run, however large). ``boost`` raises a queued job's priority
when a caller starts waiting for it. Everything here runs on the event loop
thread except the job bodies.
"""
from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierkv.errors import ManagerClosed
from tierkv.manager.transfer import Priority, Transfer
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.profile.trace import profiler_range


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Job:
    transfer: Transfer
    body: Callable[[], object]
    priority: Priority
    future: asyncio.Future
    submit: float = field(default_factory=time.perf_counter)
    start: float = 0.0
    state: JobState = JobState.QUEUED


class Executor:
    def __init__(self, threads: int, inflight_limit: int, recorder: EventRecorder) -> None:
        self.inflight_limit = inflight_limit
        self.recorder = recorder
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._heap: list[tuple[int, int, Job]] = []
        self._seq = itertools.count()
        self._running: set[Job] = set()
        self.inflight_bytes = 0
        self.peak_inflight_bytes = 0
        self._progress = asyncio.Event()

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tierkv-move")

    @property
    def queued(self) -> int:
        return sum(1 for _, _, job in self._heap if job.state is JobState.QUEUED)

    def submit(self, transfer: Transfer, body: Callable[[], object], priority: Priority) -> asyncio.Future:
        if self._pool is None:
            raise ManagerClosed("executor is not running")
        job = Job(transfer, body, priority, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, (priority, next(self._seq), job))
        self._pump()
        return job.future

    def boost(self, future: asyncio.Future, priority: Priority) -> None:
        """Raise the priority of the queued job behind ``future``."""
        for _, _, job in self._heap:
            if job.future is future and job.state is JobState.QUEUED and priority < job.priority:
                job.priority = priority
                heapq.heappush(self._heap, (priority, next(self._seq), job))
                self._pump()
                return

    async def progress(self) -> None:
        """Wait until some running job finishes."""
        self._progress.clear()
        await self._progress.wait()

    @property
    def busy(self) -> bool:
        return bool(self._running) or self.queued > 0

    def _pump(self) -> None:
        while self._heap and self._pool is not None:
            priority, _, job = self._heap[0]
            if job.state is not JobState.QUEUED or priority != job.priority:
                heapq.heappop(self._heap)  # stale entry (boosted or aborted)
                continue
            nbytes = job.transfer.nbytes
            if len(self._running) >= self._threads:
                return  # the heap, not the thread pool's FIFO, decides what runs next
            if self._running and self.inflight_bytes + nbytes > self.inflight_limit:
                return
            heapq.heappop(self._heap)
            self._launch(job)

    def _launch(self, job: Job) -> None:
        job.state = JobState.RUNNING
        self._running.add(job)
        self.inflight_bytes += job.transfer.nbytes
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._pool, self._timed, job)
        work.add_done_callback(lambda done: self._finish(job, done))

    @staticmethod
    def _timed(job: Job) -> object:
        job.start = time.perf_counter()
        t = job.transfer
        with profiler_range(f"tierkv {t.kind.value} {t.src or 'new'}->{t.dst}"):
            return job.body()

    def _finish(self, job: Job, done: asyncio.Future) -> None:
        job.state = JobState.DONE
        self._running.discard(job)
        self.inflight_bytes -= job.transfer.nbytes
        error = done.exception()
        t = job.transfer
        self.recorder.record(Event(EventKind(t.kind.value), t.src, t.dst, t.layer, t.nbytes, job.submit,
                                   job.start or job.submit, time.perf_counter(), len(t.keys),
                                   "" if error is None else type(error).__name__))
        if error is None:
            job.future.set_result(done.result())
        else:
            job.future.set_exception(error)
        self._progress.set()
        self._pump()

    async def aclose(self) -> None:
        """Abort queued jobs (their futures raise ManagerClosed), let running ones finish."""
        for _, _, job in self._heap:
            if job.state is JobState.QUEUED:
                job.state = JobState.DONE
                job.future.set_exception(ManagerClosed("tier manager closed before the transfer ran"))
        self._heap.clear()
        while self._running:
            await self.progress()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
