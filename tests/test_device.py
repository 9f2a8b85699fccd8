"""Capability shims: aligned host buffers and the staging pool the CUDA copies bounce through."""
import threading

from tierkv.device import ALIGN, StagingPool, host_buffer, staging_pool


def test_host_buffers_start_aligned():
    for size in (4096, 12288, 1 << 20):
        assert host_buffer(size, pinned=False).data_ptr() % ALIGN == 0


def test_staging_buffers_are_reused_not_made_per_read():
    pool = StagingPool(8192, keep=4)
    with pool.take(3) as first:
        assert len(first) == 3 and all(b.numel() == 8192 and b.data_ptr() % ALIGN == 0 for b in first)
        seen = {b.data_ptr() for b in first}
    for _ in range(10):
        with pool.take(3) as again:
            assert {b.data_ptr() for b in again} == seen
    assert pool.made == 3
    with pool.take(6) as many:          # more than are idle: the rest are made, and only `keep` stay
        assert len({b.data_ptr() for b in many}) == 6
    assert pool.made == 6 and len(pool._idle) == 4


def test_threads_taking_at_once_never_share_a_buffer():
    pool, held, lock = StagingPool(4096, keep=8), [], threading.Lock()
    barrier = threading.Barrier(4)

    def reader():
        with pool.take(2) as buffers:
            barrier.wait()                  # all four hold theirs at the same moment
            with lock:
                held.extend(b.data_ptr() for b in buffers)
            for b in buffers:
                b.fill_(1)
    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(held)) == 8


def test_one_pool_per_size():
    assert staging_pool(4096) is staging_pool(4096) is not staging_pool(8192)
