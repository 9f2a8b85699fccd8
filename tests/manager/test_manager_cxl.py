"""The manager with a cxl pool: between cpu and nvme, or instead of cpu; every move through it charged."""
import asyncio
import time

import pytest
import torch

from tierkv.config import TierConfig

from tierkv.knobs import IOKnobs
from tierkv.manager import TierManager
from tierkv.tiers.cxl_link import Direction, LinkSpec

from conftest import BLOCK, assert_quiescent, block, key


def config(tmp_path, **budgets) -> TierConfig:
    return TierConfig(block_bytes=BLOCK, nvme_dir=tmp_path / "store", nvme_budget=4096 * BLOCK, **budgets)


def link_matches_moves(m: TierManager) -> None:
    """Bytes booked on the pool's link are the bytes the manager moved in and out of the pool."""
    stats = m.tiers["cxl"].link.stats
    assert stats.nbytes[Direction.WRITE] == m.stats["cxl"].bytes_in
    assert stats.nbytes[Direction.READ] == m.stats["cxl"].bytes_out


async def test_pool_between_cpu_and_nvme_places_evicts_and_reads_back(tmp_path, knobs):
    cfg = config(tmp_path, gpu=0, cpu=4 * BLOCK, cxl=8 * BLOCK)
    async with TierManager.from_config(cfg, knobs=knobs) as m:
        assert m.order == ["cpu", "cxl", "nvme"]
        for i in range(30):
            await m.put(key(i), block(i))
        assert m.tiers["cxl"].pool.used == 8 and m.tiers["nvme"].pool.used >= 18
        for i in range(30):
            lease = await m.acquire([key(i)])
            assert lease.places[0][0] == "cpu"          # never read in place from the pool
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert_quiescent(m)
        for name in ("cpu", "cxl"):
            assert m.stats[name].peak_slots <= m.tiers[name].pool.capacity
        kinds = {(e.kind, e.src, e.dst) for e in m.events.events}
        assert {("demote", "cpu", "cxl"), ("demote", "cxl", "nvme"), ("load", "cxl", "cpu")} <= kinds
        assert any(e.kind == "link" and e.src == "cxl" for e in m.events.events)
        link_matches_moves(m)


async def test_pool_instead_of_cpu_with_prefetch(tmp_path, knobs):
    cfg = config(tmp_path, gpu=4 * BLOCK, cpu=0, cxl=16 * BLOCK)
    async with TierManager.from_config(cfg, knobs=knobs) as m:
        assert m.order == ["gpu", "cxl", "nvme"]
        for i in range(12):
            await m.put(key(i), block(i), tier="cxl")
        m.prefetch([key(0), key(1)])                       # background, into the fastest tier
        for _ in range(1000):
            if all("gpu" in m.where(key(i)) for i in (0, 1)):
                break
            await asyncio.sleep(0.002)
        lease = await m.acquire([key(0), key(1)])
        assert [name for name, _ in lease.places] == ["gpu", "gpu"]
        lease.release()
        assert any(e.kind == "prefetch" and e.src == "cxl" and e.dst == "gpu" for e in m.events.events)
        lease = await m.acquire([key(i) for i in range(2, 5)])
        assert all(name == "gpu" for name, _ in lease.places)
        assert all(torch.equal(v, block(i + 2)) for i, v in enumerate(lease.views))
        lease.release()
        assert m.stats["gpu"].peak_slots <= 4 and m.stats["cxl"].peak_slots <= 16
        link_matches_moves(m)


@pytest.mark.serial
async def test_a_load_from_the_pool_costs_the_modelled_time(tmp_path):
    slow = dict(cxl_read_gbps=0.004, cxl_write_gbps=1.0, cxl_latency_ns=1e6)   # 4 MB/s, 1 ms
    cfg = config(tmp_path, gpu=0, cpu=32 * BLOCK, cxl=32 * BLOCK, **slow)
    knobs = IOKnobs(copy_threads=2, inflight_bytes=64 * BLOCK)
    async with TierManager.from_config(cfg, knobs=knobs) as m:
        keys = [key(i) for i in range(24)]
        for i, k in enumerate(keys):
            await m.put(k, block(i), tier="cxl")
        start = time.perf_counter()
        lease = await m.acquire(keys, "cpu")              # one transfer of 24 blocks (96 KiB)
        elapsed = time.perf_counter() - start
        lease.release()
        spec: LinkSpec = m.tiers["cxl"].link.spec
        expected = 24 * BLOCK / (spec.read_gbps * 1e9) + spec.latency_ns * 1e-9   # 25.6 ms
        assert expected <= elapsed <= expected * 1.2 + 0.05
        link_matches_moves(m)
