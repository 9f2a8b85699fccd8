"""The manager over a real NVMe store: demotion, write-back, reopen, a full disk."""
import pytest
import torch

from tierkv.errors import BudgetExceeded, DiskFullError
from tierkv.manager import TierManager
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.nvme import NvmeTier

from conftest import BLOCK, assert_quiescent, block, key


def tiers(path, gpu=2, cpu=4, nvme=4096):
    return [GpuTier(BLOCK, gpu * BLOCK), CpuTier(BLOCK, cpu * BLOCK), NvmeTier(path, BLOCK, nvme * BLOCK)]


async def test_protected_blocks_are_demoted_to_disk_not_dropped(tmp_path, knobs):
    async with TierManager(tiers(tmp_path / "s"), knobs=knobs) as m:
        for i in range(40):
            await m.put(key(i), block(i))
        assert m.tiers["nvme"].pool.used >= 34
        for i in range(40):
            lease = await m.acquire([key(i)], "gpu")
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert_quiescent(m)


async def test_persisted_blocks_survive_reopen(tmp_path, knobs):
    async with TierManager(tiers(tmp_path / "s"), knobs=knobs) as m:
        for i in range(10):
            await m.put(key(i), block(i), persist=True)
        await m.flush()
    async with TierManager(tiers(tmp_path / "s"), knobs=knobs) as again:
        assert all(again.where(key(i)) == ["nvme"] for i in range(10))
        lease = await again.acquire([key(i) for i in range(4)], "cpu")
        assert all(torch.equal(v, block(i)) for i, v in enumerate(lease.views))
        lease.release()
        with pytest.raises(BudgetExceeded, match="blocks requested, the budget holds 4"):
            await again.acquire([key(i) for i in range(10)], "cpu")


async def test_unprotected_store_blocks_are_evicted_under_the_cap(tmp_path, knobs):
    async with TierManager(tiers(tmp_path / "s", nvme=8), knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), persist=True, protect=False)
        await m.flush()
        for i in range(8, 12):
            await m.put(key(i), block(i), persist=True)
        await m.flush()
        assert m.tiers["nvme"].pool.used <= 8
        assert all(m.contains(key(i)) for i in range(8, 12))


async def test_corrupt_block_on_disk_is_reported_and_dropped(tmp_path, knobs):
    from tierkv.errors import BlockCorrupt
    async with TierManager(tiers(tmp_path / "s"), knobs=knobs) as m:
        await m.put(key(1), block(1), tier="nvme")
        slot = m.directory.entry(key(1)).copies["nvme"]
        with open(tmp_path / "s" / "slots.dat", "r+b") as f:
            f.seek(slot * BLOCK + 10)
            f.write(b"\x00\x01\x02")
        with pytest.raises(BlockCorrupt):
            await m.acquire([key(1)], "cpu")
        assert not m.contains(key(1))
        assert_quiescent(m)


async def test_full_disk_raises_and_loses_nothing_from_upper_tiers(tiny_tmpfs, knobs):
    async with TierManager([CpuTier(BLOCK, 1024 * BLOCK), NvmeTier(tiny_tmpfs, BLOCK, 4096 * BLOCK)],
                           knobs=knobs) as m:
        for i in range(1000):  # 4 MB of blocks, a 2 MiB disk
            await m.put(key(i), block(i), persist=True)
        with pytest.raises(DiskFullError, match="space"):
            await m.flush()
        for i in range(1000):  # every block is still served, from memory or disk, intact
            lease = await m.acquire([key(i)], "cpu")
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert_quiescent(m)
