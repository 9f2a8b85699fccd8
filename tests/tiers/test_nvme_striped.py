"""StripedIO on its own: checksums beside the I/O, verification beside later reads, failure, shutdown."""
from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest

from tierkv.tiers import nvme_striped
from tierkv.tiers.nvme_striped import (BACKGROUND, LAST, UNREADABLE, URGENT, JobQueue, StripedIO, checksum, plan_runs,
                                      plan_tasks)

BB = 4096


class MemoryFile:
    """A BlockFile in memory; ``before(kind, offset)`` runs first in every call."""

    name = "memory"
    fd = -1
    needs_alignment = False

    def __init__(self, slots: int, before=lambda kind, offset: None) -> None:
        self.data = bytearray(slots * BB)
        self.before = before

    def pwritev(self, bufs, offset: int) -> None:
        self.before("write", offset)
        for buf in bufs:
            self.data[offset:offset + buf.nbytes] = buf.tobytes()
            offset += buf.nbytes

    def preadv(self, bufs, offset: int) -> int:
        self.before("read", offset)
        total = 0
        for buf in bufs:
            buf[:] = np.frombuffer(self.data, np.uint8, buf.nbytes, offset + total)
            total += buf.nbytes
        return total

    def close(self) -> None:
        pass


def blocks(n: int) -> list[np.ndarray]:
    """Block i holds the byte i everywhere, so its first byte names it."""
    return [np.full(BB, i, np.uint8) for i in range(n)]


class Hashes(list):
    """Names of the blocks hashed so far, in order, and the threads that hashed them."""

    threads: dict[int, int]


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Hashes:
    seen = Hashes()
    seen.threads = {}

    def recording(block):
        seen.threads[int(block[0])] = threading.get_ident()
        seen.append(int(block[0]))
        return checksum(block)

    monkeypatch.setattr(nvme_striped, "checksum", recording)
    return seen


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_roundtrip_returns_each_blocks_checksum_in_input_order() -> None:
    file = MemoryFile(64)
    io = StripedIO(file, BB, threads=3)
    try:
        slots = [9, 3, 4, 5, 40, 41, 0, 63, 10, 11, 12, 13, 14]
        src = blocks(len(slots))
        assert io.write(slots, src) == [checksum(b) for b in src]
        dst = [np.zeros(BB, np.uint8) for _ in slots]
        assert io.read(slots, dst) == [checksum(b) for b in src]
        assert all(np.array_equal(a, b) for a, b in zip(src, dst))
        assert io.write([], []) == [] and io.read([], []) == []
    finally:
        io.close()


def test_write_hashes_on_the_caller_while_the_worker_writes(monkeypatch: pytest.MonkeyPatch,
                                                             hashed: Hashes) -> None:
    monkeypatch.setattr(nvme_striped, "WRITE_TASKS_PER_THREAD", 1)
    writers: list[int] = []

    def before(kind: str, offset: int) -> None:  # the write is in flight until every block is hashed
        writers.append(threading.get_ident())
        assert wait_for(lambda: len(hashed) == 8)

    io = StripedIO(MemoryFile(8, before), BB, threads=1)
    try:
        src = blocks(8)
        assert io.write(list(range(8)), src) == [checksum(b) for b in src]
    finally:
        io.close()
    assert len(writers) == 1 and set(hashed.threads.values()) == {threading.get_ident()} != set(writers)


def test_read_verifies_each_run_while_the_next_is_read(monkeypatch: pytest.MonkeyPatch, hashed: Hashes) -> None:
    monkeypatch.setattr(nvme_striped, "READ_TASKS_PER_THREAD", 4)  # 8 blocks, 1 thread: runs of 2
    file = MemoryFile(8)
    io = StripedIO(file, BB, threads=1)
    try:
        src = blocks(8)
        io.write(list(range(8)), src)
        hashed.clear()
        waited: list[bool] = []
        readers: set[int] = set()

        def before(kind: str, offset: int) -> None:  # run k is read only once run k-1 is verified
            first = offset // BB
            readers.add(threading.get_ident())
            waited.append(wait_for(lambda: first == 0 or first - 1 in hashed))

        file.before = before
        dst = [np.zeros(BB, np.uint8) for _ in range(8)]
        assert io.read(list(range(8)), dst) == [checksum(b) for b in src]
    finally:
        io.close()
    assert waited == [True] * 4
    assert sorted(hashed) == list(range(8))  # each block once
    caller = threading.get_ident()
    assert [hashed.threads[b] == caller for b in range(8)] == [True] * 6 + [False] * 2  # the last run: its worker
    assert caller not in readers


def test_failed_run_skips_the_rest_and_wait_outlasts_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme_striped, "WRITE_TASKS_PER_THREAD", 8)  # 64 blocks, 2 threads: 16 runs of 4
    ended: list[float] = []
    calls = 0

    def before(kind: str, offset: int) -> None:
        nonlocal calls
        calls += 1
        if offset == 0:
            raise OSError(errno.EIO, "injected")
        time.sleep(0.02)
        ended.append(time.monotonic())

    io = StripedIO(MemoryFile(64, before), BB, threads=2)
    try:
        with pytest.raises(OSError, match="injected"):
            io.write(list(range(64)), blocks(64))
        raised = time.monotonic()
    finally:
        io.close()
    assert calls < len(plan_runs(list(range(64)), 4)) // 2  # runs not started when it failed were skipped
    assert all(end <= raised for end in ended)          # and none was still running when write raised


def test_a_read_error_marks_only_that_run_unreadable() -> None:
    file = MemoryFile(16)
    io = StripedIO(file, BB, threads=2)
    try:
        src = blocks(16)
        io.write(list(range(16)), src)

        def before(kind: str, offset: int) -> None:
            if offset == 4 * BB:
                raise OSError(errno.EIO, "injected")

        file.before = before
        sums = io.read([0, 4, 12], [np.zeros(BB, np.uint8) for _ in range(3)])
    finally:
        io.close()
    assert sums == [checksum(src[0]), UNREADABLE, checksum(src[12])]


def test_a_read_task_that_raises_fails_the_read_with_its_own_error() -> None:
    """Tasks skipped after the error report nothing whole; the caller does not trip over them."""
    file = MemoryFile(16)
    io = StripedIO(file, BB, threads=1)
    try:
        io.write(list(range(16)), blocks(16))

        def before(kind: str, offset: int) -> None:
            if kind == "read":
                raise RuntimeError("injected")

        file.before = before
        with pytest.raises(RuntimeError, match="injected") as raised:
            io.read(list(range(0, 16, 2)), [np.zeros(BB, np.uint8) for _ in range(8)])
    finally:
        io.close()
    assert raised.value.__context__ is None


def test_plan_tasks_deals_runs_in_order_as_evenly_as_can_be() -> None:
    runs = [[i] for i in range(7)]
    assert plan_tasks(runs, 3) == [[[0], [1]], [[2], [3]], [[4], [5], [6]]]
    assert plan_tasks(runs[:2], 4) == [[[0]], [[1]]]
    assert plan_tasks([], 4) == []


def test_scattered_blocks_are_read_a_task_of_runs_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """12 blocks on every other slot, 1 thread, 2 tasks: 6 runs (one call each) per claim; a
    failed call in the middle of a task makes that block unreadable only."""
    monkeypatch.setattr(nvme_striped, "READ_TASKS_PER_THREAD", 2)
    file = MemoryFile(24)
    io = StripedIO(file, BB, threads=1)
    try:
        slots = list(range(0, 24, 2))
        src = blocks(12)
        io.write(slots, src)
        claims: list[int] = []
        real = nvme_striped.Job.do_tasks

        def counted(job, preempted=lambda priority: False):
            claims.append(len(job.tasks))
            return real(job, preempted)

        monkeypatch.setattr(nvme_striped.Job, "do_tasks", counted)
        file.before = lambda kind, offset: _fail_at(offset, 8 * BB)
        sums = io.read(slots, [np.zeros(BB, np.uint8) for _ in slots])
    finally:
        io.close()
    assert claims == [2]
    assert sums == [UNREADABLE if s == 8 else checksum(b) for s, b in zip(slots, src)]


def _fail_at(offset: int, bad: int) -> None:
    if offset == bad:
        raise OSError(errno.EIO, "injected")


def test_close_stops_every_worker() -> None:
    io = StripedIO(MemoryFile(4), BB, threads=3)
    workers = list(io._workers)
    assert all(w.is_alive() for w in workers)
    io.close()
    assert not any(w.is_alive() for w in workers)
    assert not [t for t in threading.enumerate() if t in workers]


class Named:
    def __init__(self, name: str, priority: int) -> None:
        self.name, self.priority = name, priority


def test_job_queue_serves_the_most_urgent_first_then_in_order_of_arrival() -> None:
    jobs = JobQueue()
    jobs.put(Named("writeback", LAST))
    jobs.put(Named("guess", BACKGROUND), copies=2)
    jobs.put(None)                           # a worker's stop: after every job queued before it
    jobs.put(Named("wanted", URGENT))
    jobs.put(Named("wanted too", URGENT))
    assert jobs.more_urgent(BACKGROUND) and not jobs.more_urgent(URGENT)
    served = [jobs.get() for _ in range(6)]
    assert [None if job is None else job.name for job in served] == \
        ["wanted", "wanted too", "guess", "guess", "writeback", None]
    assert not jobs.more_urgent(LAST)


def test_an_urgent_read_overtakes_a_background_read_under_way() -> None:
    order: list[int] = []

    def before(kind: str, offset: int) -> None:
        if kind == "read":
            order.append(offset // BB)
            time.sleep(0.01)

    file = MemoryFile(64)
    io = StripedIO(file, BB, threads=1)
    try:
        src = blocks(64)
        io.write(list(range(64)), src)
        file.before = before
        background = list(range(0, 40, 2))   # 20 runs of one block: nothing adjacent
        got: dict[str, list] = {}
        reader = threading.Thread(target=lambda: got.update(
            guess=io.read(background, [np.zeros(BB, np.uint8) for _ in background], priority=BACKGROUND)))
        reader.start()
        assert wait_for(lambda: len(order) >= 2)
        bufs = [np.zeros(BB, np.uint8) for _ in range(2)]
        sums = io.read([41, 43], bufs)       # URGENT, the default
        reader.join()
    finally:
        io.close()
    first = order.index(41)
    assert order[first:first + 2] == [41, 43]
    assert first <= order.index(background[2]) + 2          # at most the run under way, and one more
    assert len(order) == len(background) + 2 and sorted(order[:first] + order[first + 2:]) == background
    assert sums == [checksum(src[41]), checksum(src[43])] and int(bufs[1][0]) == 43
    assert got["guess"] == [checksum(src[i]) for i in background]
