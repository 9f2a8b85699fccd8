"""The executor over a runner the test drives by hand: priority order, boosts, limits, close; the thread
runner finishing a transfer left on a device stream once its event is done."""
from __future__ import annotations

import asyncio

import pytest

from tierkv.errors import ManagerClosed
from tierkv.events import EventRecorder
from tierkv.manager.executor import Executor, Finish, Job, ThreadRunner
from tierkv.manager.transfer import InFlight, Kind, Priority, Transfer

from conftest import BLOCK, key


class HandRunner:
    """Starts nothing by itself: ``finish_next`` completes the oldest started job."""

    def __init__(self) -> None:
        self.started: list[tuple[Job, Finish]] = []
        self.closed = False

    def clock(self) -> float:
        return 0.0

    def start(self) -> None:
        pass

    def run(self, job: Job, finish: Finish) -> None:
        self.started.append((job, finish))

    def finish_next(self, error: BaseException | None = None) -> None:
        job, finish = self.started.pop(0)
        finish(job, job.body() if error is None else None, error)

    def close(self) -> None:
        self.closed = True


def move(i: int, dst: str = "gpu", blocks: int = 1) -> Transfer:
    keys = tuple(key(i + n) for n in range(blocks))
    return Transfer(Kind.LOAD, "nvme", dst, keys, (0,) * blocks, (0,) * blocks, blocks * BLOCK)


def started(runner: HandRunner) -> list[int]:
    return [job.body() for job, _ in runner.started]


def executor(runner: HandRunner, threads: int = 1, inflight: int = 64 * BLOCK) -> Executor:
    ex = Executor(threads, inflight, EventRecorder(), runner)
    ex.start()
    return ex


async def test_queued_jobs_start_in_priority_order_and_a_boost_jumps_the_queue() -> None:
    runner = HandRunner()
    ex = executor(runner)
    ex.submit(move(0), lambda: 0, Priority.NOW)
    ex.submit(move(1), lambda: 1, Priority.WRITEBACK)
    ex.submit(move(2), lambda: 2, Priority.PREFETCH)
    ex.submit(move(3, dst="cpu"), lambda: 3, Priority.PREFETCH)
    ex.submit(move(3), lambda: 4, Priority.PREFETCH)
    assert started(runner) == [0] and ex.queued == 4
    ex.boost_moves(key(3), "gpu", Priority.NOW)   # the move into gpu only, not the one into cpu
    order = []
    while runner.started:
        order.append(runner.started[0][0].body())
        runner.finish_next()
    assert order == [0, 4, 2, 3, 1]
    assert not ex.busy and ex.inflight_bytes == 0


async def test_bytes_in_flight_stay_under_the_limit_but_one_job_always_runs() -> None:
    runner = HandRunner()
    ex = executor(runner, threads=4, inflight=3 * BLOCK)
    big = ex.submit(move(0, blocks=5), lambda: "big", Priority.NOW)
    ex.submit(move(10, blocks=2), lambda: "small", Priority.NOW)
    assert started(runner) == ["big"]                  # over the limit alone: it runs anyway
    runner.finish_next()
    assert await big == "big" and started(runner) == ["small"]
    assert ex.peak_inflight_bytes == 5 * BLOCK


async def test_a_failed_body_fails_its_future_and_is_recorded() -> None:
    runner = HandRunner()
    ex = executor(runner)
    work = ex.submit(move(0), lambda: None, Priority.NOW)
    runner.finish_next(OSError("disk"))
    with pytest.raises(OSError, match="disk"):
        await work
    assert [e.error for e in ex.recorder.events] == ["OSError"]


async def test_on_done_hears_each_outcome_as_the_job_finishes_before_the_next_job_starts() -> None:
    runner = HandRunner()
    ex = executor(runner)
    heard = []
    first = ex.submit(move(0), lambda: "ok", Priority.NOW,
                      lambda result, error: heard.append((result, error, [j.body() for j, _ in runner.started])))
    second = ex.submit(move(1), lambda: None, Priority.NOW, lambda result, error: heard.append((result, error)))
    runner.finish_next()
    assert heard == [("ok", None, [])]           # the second job was not started yet when it ran
    assert started(runner) == [None]
    failure = OSError("disk")
    runner.finish_next(failure)
    assert heard[1] == (None, failure)
    assert await first == "ok"
    with pytest.raises(OSError, match="disk"):
        await second


async def test_a_thread_runner_hands_a_body_s_error_to_the_loop() -> None:
    ex = Executor(1, 64 * BLOCK, EventRecorder(), ThreadRunner(1))
    ex.start()
    heard = []

    def body():
        raise OSError("disk")

    work = ex.submit(move(0), body, Priority.NOW, lambda result, error: heard.append(error))
    with pytest.raises(OSError, match="disk"):
        await work
    assert [type(e) for e in heard] == [OSError]
    await ex.aclose()


async def test_close_aborts_queued_jobs_waits_for_running_ones_then_closes_the_runner() -> None:
    runner = HandRunner()
    ex = executor(runner)
    running = ex.submit(move(0), lambda: 0, Priority.NOW)
    queued = ex.submit(move(1), lambda: 1, Priority.NOW)
    closing = asyncio.create_task(ex.aclose())
    await asyncio.sleep(0)
    assert not runner.closed                         # the running job has not finished
    runner.finish_next()
    await closing
    assert runner.closed and await running == 0
    with pytest.raises(ManagerClosed):
        await queued
    with pytest.raises(ManagerClosed, match="not running"):
        ex.submit(move(2), lambda: 2, Priority.NOW)


class DeviceEvent:
    """The part of ``torch.cuda.Event`` a runner uses: ``query()``, true once the device is done."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


async def test_a_transfer_left_on_a_device_stream_finishes_when_its_event_does_and_frees_its_worker() -> None:
    event = DeviceEvent()
    ex = Executor(2, 64 * BLOCK, EventRecorder(), ThreadRunner(1))   # two jobs may run, on one worker thread
    ex.start()
    copying = ex.submit(move(0), lambda: InFlight(event, [key(0)]), Priority.NOW)
    plain = ex.submit(move(1), lambda: [], Priority.NOW)
    assert await asyncio.wait_for(plain, 5) == []          # the worker was free while the copies ran
    await asyncio.sleep(0.01)
    assert not copying.done() and event.queries > 1       # polled, not waited on
    event.done = True
    assert await asyncio.wait_for(copying, 5) == [key(0)]
    assert ex.inflight_bytes == 0
    await ex.aclose()
