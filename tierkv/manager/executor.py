"""Runs transfers in priority order, with bounded bytes in flight, on a pluggable runner.

The queue is a heap of (priority, sequence): a load a caller waits for beats
a prefetch, which beats a write-back; equal priorities run in submit order.
A job starts when a runner slot is free and the bytes in flight plus its own
stay under the limit (one job always may run, however large). ``boost`` and
``boost_moves`` raise queued jobs' priority when a caller starts waiting for
them. Everything here runs on the event loop thread except the job bodies.

A `Runner` decides where a started job's body runs and when it is over::

    Executor ──run(job, finish)──▶ Runner          ThreadRunner: a worker thread, real time
        ▲                            │             (the replay passes one that completes at
        └──── finish(job, result, error) on the loop      a modelled, virtual time)

A body that leaves copies on a device stream returns `InFlight`; the thread
runner frees its worker and finishes the job once the event's ``query()`` is
true, polled from the loop: no thread waits in ``synchronize()``.

``Runner.clock`` stamps a job's submit and done times, so the events a run
records and those a simulated run records share one time base each.
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
from typing import Protocol

from tierkv.errors import ManagerClosed
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.keys import BlockKey
from tierkv.manager.transfer import InFlight, Priority, Transfer
from tierkv.profile.trace import profiler_range


POLL_S = 50e-6   # how often the loop asks a device event whether a transfer's copies are done


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
    on_done: Callable[[object, BaseException | None], None] | None = None   # called as the job finishes
    submit: float = field(default_factory=time.perf_counter)
    start: float = 0.0
    state: JobState = JobState.QUEUED


Finish = Callable[[Job, object, "BaseException | None"], None]


class Runner(Protocol):
    """Where job bodies run. ``run`` sets ``job.start`` when the body begins and calls
    ``finish(job, result, error)`` on the event loop once it is over (``error``: what the body
    raised). ``start`` and ``close`` bracket its life; ``close`` runs when no job is running."""

    def clock(self) -> float: ...

    def start(self) -> None: ...

    def run(self, job: Job, finish: Finish) -> None: ...

    def close(self) -> None: ...


class ThreadRunner:
    """Bodies run on ``threads`` worker threads ("tierkv-move"); times are ``perf_counter`` seconds."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def clock() -> float:
        return time.perf_counter()

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tierkv-move")

    def run(self, job: Job, finish: Finish) -> None:
        loop = asyncio.get_running_loop()

        def body() -> None:   # its outcome reaches the loop in one callback, not a chain of futures
            try:
                result, error = _timed(job), None
            except BaseException as raised:   # noqa: BLE001 - handed to the loop, which raises it to the caller
                result, error = None, raised
            if not loop.is_closed():
                loop.call_soon_threadsafe(_when_landed, loop, job, finish, result, error)

        self._pool.submit(body)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _timed(job: Job) -> object:
    job.start = time.perf_counter()
    t = job.transfer
    with profiler_range(f"tierkv {t.kind.value} {t.src or 'new'}->{t.dst}"):
        return job.body()


def _when_landed(loop: asyncio.AbstractEventLoop, job: Job, finish: Finish, result: object,
                 error: BaseException | None) -> None:
    """Finish ``job`` once its body is over and, if it left copies on a device stream (`InFlight`),
    once their event says they are done: polled from the loop, so the worker is free meanwhile."""
    if error is None and isinstance(result, InFlight):
        if not result.event.query():
            loop.call_later(POLL_S, _when_landed, loop, job, finish, result, None)
            return
        result = result.failed
    finish(job, result, error)


class Executor:
    def __init__(self, threads: int, inflight_limit: int, recorder: EventRecorder,
                 runner: Runner | None = None) -> None:
        """``threads`` jobs run at once, on ``runner`` (default: that many worker threads)."""
        self.inflight_limit = inflight_limit
        self.recorder = recorder
        self._threads = threads
        self._runner = runner or ThreadRunner(threads)
        self._open = False
        self._heap: list[tuple[int, int, Job]] = []
        self._seq = itertools.count()
        self._running: set[Job] = set()
        self.inflight_bytes = 0
        self.peak_inflight_bytes = 0
        self._progress = asyncio.Event()

    def start(self) -> None:
        self._runner.start()
        self._open = True

    @property
    def queued(self) -> int:
        return sum(1 for _, _, job in self._heap if job.state is JobState.QUEUED)

    def submit(self, transfer: Transfer, body: Callable[[], object], priority: Priority,
               on_done: Callable[[object, BaseException | None], None] | None = None) -> asyncio.Future:
        """Queue ``body``; its future gets the result. ``on_done(result, error)`` runs on the loop as the
        job finishes, before the future's callbacks (which wait for a later turn of the loop)."""
        if not self._open:
            raise ManagerClosed("executor is not running")
        job = Job(transfer, body, priority, asyncio.get_running_loop().create_future(), on_done,
                  submit=self._runner.clock())
        self._push(job)
        self._pump()
        return job.future

    def boost(self, future: asyncio.Future, priority: Priority) -> None:
        """Raise the priority of the queued job behind ``future``."""
        job = next((job for _, _, job in self._heap if job.future is future), None)
        if job is not None:
            self._raise(job, priority)

    def boost_moves(self, key: BlockKey, dst: str, priority: Priority) -> None:
        """Raise every queued job that moves ``key`` into tier ``dst`` to ``priority``."""
        jobs = [job for _, _, job in self._heap if job.transfer.dst == dst and key in job.transfer.keys]
        for job in dict.fromkeys(jobs):
            self._raise(job, priority)

    async def progress(self) -> None:
        """Wait until some running job finishes."""
        self._progress.clear()
        await self._progress.wait()

    @property
    def busy(self) -> bool:
        return bool(self._running) or self.queued > 0

    def _push(self, job: Job) -> None:
        heapq.heappush(self._heap, (job.priority, next(self._seq), job))

    def _raise(self, job: Job, priority: Priority) -> None:
        if job.state is JobState.QUEUED and priority < job.priority:
            job.priority = priority
            self._push(job)   # the old entry goes stale: _pump drops it
            self._pump()

    def _pump(self) -> None:
        while self._heap and self._open:
            priority, _, job = self._heap[0]
            if job.state is not JobState.QUEUED or priority != job.priority:
                heapq.heappop(self._heap)  # stale entry (boosted or aborted)
                continue
            nbytes = job.transfer.nbytes
            if len(self._running) >= self._threads:
                return  # the heap, not the runner's own queue, decides what runs next
            if self._running and self.inflight_bytes + nbytes > self.inflight_limit:
                return
            heapq.heappop(self._heap)
            self._launch(job)

    def _launch(self, job: Job) -> None:
        job.state = JobState.RUNNING
        self._running.add(job)
        self.inflight_bytes += job.transfer.nbytes
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)
        self._runner.run(job, self._finish)

    def _finish(self, job: Job, result: object, error: BaseException | None) -> None:
        job.state = JobState.DONE
        self._running.discard(job)
        self.inflight_bytes -= job.transfer.nbytes
        t = job.transfer
        self.recorder.record(Event(EventKind(t.kind.value), t.src, t.dst, t.layer, t.nbytes, job.submit,
                                   job.start or job.submit, self._runner.clock(), len(t.keys),
                                   "" if error is None else type(error).__name__))
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
            if job.on_done is not None:
                job.future.exception()   # retrieved: on_done hands the error on
        try:
            if job.on_done is not None:
                job.on_done(result, error)
        finally:
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
        if self._open:
            self._open = False
            self._runner.close()
