"""The manager over a real NVMe store: demotion, write-back, reopen, a full disk, a cancelled read."""
import asyncio
import time

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


async def test_a_put_of_many_blocks_places_them_together_and_writes_them_back_in_one_write(tmp_path, knobs, monkeypatch):
    """12 new blocks (one named twice) over a gpu tier of 2 and a cpu tier of 4 slots: the free slots
    take 6 in two transfers, room is made in the gpu tier for the rest; ``persist`` writes back each
    source tier's blocks in one store write. Reopened, every block reads back exactly."""
    writes, real = [], NvmeTier.write
    monkeypatch.setattr(NvmeTier, "write", lambda self, items, **kw: (writes.append(len(items)),
                                                                      real(self, items, **kw))[1])
    named = [*range(12), 3]
    async with TierManager(tiers(tmp_path / "s"), knobs=knobs) as m:
        await m.put_many([key(i) for i in named], torch.stack([block(i) for i in named]), layer=0, first_index=0,
                         persist=True)
        await m.flush()
        puts = [(e.dst, e.blocks) for e in m.events.of_kind("put")]
        assert puts[:2] == [("gpu", 2), ("cpu", 4)] and sum(n for _, n in puts) == 12
        assert m.directory.entry(key(3)).holders == 2                   # named twice: held twice, stored once
        assert sum(writes) == 12 and len(writes) < 12                   # demotions and write-backs in batches
        assert_quiescent(m)
    async with TierManager(tiers(tmp_path / "s"), knobs=knobs) as again:
        assert all(again.where(key(i)) == ["nvme"] for i in range(12))
        for first in range(0, 12, 4):
            lease = await again.acquire([key(i) for i in range(first, first + 4)], "cpu")
            assert all(torch.equal(v, block(i)) for i, v in enumerate(lease.views, start=first))
            lease.release()


async def test_a_put_of_many_that_finds_no_room_stores_none_of_what_it_could_not_place(knobs):
    async with TierManager([CpuTier(BLOCK, 3 * BLOCK)], knobs=knobs) as m:
        await m.put_many([key(i) for i in range(2)], torch.stack([block(i) for i in range(2)]))
        with pytest.raises(BudgetExceeded, match="cpu"):
            await m.put_many([key(i) for i in range(2, 5)], torch.stack([block(i) for i in range(2, 5)]))  # 1 fits
        assert m.contains(key(2)) and not m.contains(key(3)) and not m.contains(key(4))
        assert m.directory.entry(key(2)).holders == 0            # the failed call holds nothing
        await m.put_many([key(2)], block(2))                     # asked again: held, not stored twice
        assert m.directory.entry(key(2)).holders == 1 and m.used_bytes("cpu") == 3 * BLOCK
        assert_quiescent(m)


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


async def test_a_full_disk_under_eviction_pressure_loses_no_block_it_took(tiny_tmpfs, knobs):
    """A cpu tier of 64 blocks over a 2 MiB disk: protected blocks must go down to the disk to make
    room, and the disk fills. A put (or a read needing room) that fails says so; every block a put
    took stays stored with its own bytes, and once the caller lets go of some, the rest read back."""
    from tierkv.errors import TierKVError
    taken, refused = [], 0
    async with TierManager([CpuTier(BLOCK, 64 * BLOCK), NvmeTier(tiny_tmpfs, BLOCK, 4096 * BLOCK)],
                           knobs=knobs) as m:
        for i in range(1000):  # 4 MB of protected blocks
            try:
                await m.put(key(i), block(i))
                taken.append(i)
            except (DiskFullError, BudgetExceeded) as error:
                assert isinstance(error, TierKVError) and ("space" in str(error) or "slots" in str(error))
                refused += 1
        assert refused and len(taken) > 64 and m.used_bytes("nvme") > 0   # the disk took some, then filled
        for i in taken:                      # each copy where it lies, read without making room
            copies = m.directory.entry(key(i)).copies
            assert copies
            for name, slot in copies.items():
                data = torch.empty(BLOCK, dtype=torch.uint8)
                if name == "nvme":
                    assert m.tiers[name].read([(key(i), slot, data)]) == []
                else:
                    data = m.tiers[name].view(slot)
                assert torch.equal(data, block(i))
        await m.drop([key(i) for i in taken[:len(taken) // 2]])
        for i in taken[len(taken) // 2:]:
            lease = await m.acquire([key(i)], "cpu")
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert_quiescent(m)


async def test_a_reader_that_never_unpins_makes_a_full_tier_fail_after_the_pin_wait(knobs):
    """Every slot of the only tier pinned by a reader: a put waits ``pin_wait_s`` for an unpin, then
    says the tier is full of pinned blocks; once the reader lets go, the put goes through."""
    import time
    async with TierManager([CpuTier(BLOCK, 4 * BLOCK)], knobs=knobs) as m:
        m.pin_wait_s = 0.3
        for i in range(4):
            await m.put(key(i), block(i), protect=False)
        lease = await m.acquire([key(i) for i in range(4)], "cpu")
        start = time.perf_counter()
        with pytest.raises(BudgetExceeded, match="pinned"):
            await m.put(key(9), block(9))
        assert 0.25 <= time.perf_counter() - start < 5
        lease.release()
        await m.put(key(9), block(9))
        assert m.contains(key(9))
        assert_quiescent(m)


async def test_a_read_cancelled_before_its_loads_start_leaves_no_claim_behind(tmp_path, knobs):
    async with TierManager(tiers(tmp_path / "s", gpu=16, cpu=4), knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), tier="nvme")
        task = asyncio.ensure_future(m.acquire([key(i) for i in range(8)], "gpu"))
        await asyncio.sleep(0)          # the read announced its loads; they have not started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        lease = await asyncio.wait_for(m.acquire([key(0), key(1)], "gpu"), 10)   # joins no stale load
        assert torch.equal(lease.views[1], block(1))
        lease.release()
        while m._executor.busy:
            await m._executor.progress()
        assert_quiescent(m)


async def test_a_block_dropped_while_a_scrub_reads_it_waits_for_the_read(tmp_path, knobs, monkeypatch):
    """The scrub pins the store's copy while it reads it: a drop meanwhile waits for the read, then
    removes the block; neither raises, and nothing stays pinned."""
    async with TierManager([CpuTier(BLOCK, 4 * BLOCK), NvmeTier(tmp_path, BLOCK, 64 * BLOCK)], knobs=knobs) as m:
        await m.put(key(1), block(1), tier="nvme")
        store = m.tiers["nvme"]
        real = store.read
        monkeypatch.setattr(store, "read", lambda items, **kw: (time.sleep(0.3), real(items, **kw))[1])  # a slow disk
        scrub = asyncio.create_task(m.scrub([key(1)]))
        await asyncio.sleep(0.05)
        await m.drop([key(1)])
        await scrub
        assert store.lookup(key(1)) is None and not m.contains(key(1))
        assert_quiescent(m)


async def test_a_store_reopened_alone_makes_room_by_evicting_the_blocks_it_found(tmp_path, knobs):
    """The blocks found at open lie in extents nobody holds yet: evicting one claims its extent and
    frees its slot, so a full store takes new blocks (only another live process's blocks are kept)."""
    def tiers_of():
        return [CpuTier(BLOCK, 2 * BLOCK), NvmeTier(tmp_path, BLOCK, 8 * BLOCK)]
    async with TierManager(tiers_of(), knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), persist=True, protect=False)
        await m.flush()
    async with TierManager(tiers_of(), knobs=knobs) as m:
        for i in range(8, 12):
            await m.put(key(i), block(i), persist=True, protect=False)
        await m.flush()
        assert len(m.tiers["nvme"]) == 8 and m.contains(key(11))
        lease = await m.acquire([key(11)], "cpu")
        assert torch.equal(lease.views[0], block(11))
        lease.release()
        assert_quiescent(m)
