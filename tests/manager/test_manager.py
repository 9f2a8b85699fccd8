import asyncio
import random
import threading

import pytest
import torch

from tierkv.errors import BlockMissing, BudgetExceeded, ManagerClosed
from tierkv.manager import TierManager
from tierkv.tiers.base import Medium
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.nvme import NvmeTier

from conftest import BLOCK, SlowTier, assert_quiescent, block, key


def two_tiers(gpu_slots=4, cpu_slots=16):
    return [GpuTier(BLOCK, gpu_slots * BLOCK), CpuTier(BLOCK, cpu_slots * BLOCK)]


async def test_put_spills_down_and_reads_back_exactly(knobs):
    async with TierManager(two_tiers(), knobs=knobs) as m:
        for i in range(12):
            await m.put(key(i), block(i))
        assert m.tiers["gpu"].pool.used <= 4
        assert sum(bool(m.where(key(i))) for i in range(12)) == 12
        for i in random.Random(0).sample(range(12), 12):
            lease = await m.acquire([key(i)], "gpu")
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert_quiescent(m)
        assert m.stats["gpu"].peak_slots <= 4


async def test_acquire_any_memory_tier_does_not_copy(knobs):
    async with TierManager(two_tiers(), knobs=knobs) as m:
        await m.put(key(1), block(1), tier="cpu")
        lease = await m.acquire([key(1)])
        assert lease.places[0][0] == "cpu" and m.where(key(1)) == ["cpu"]
        lease.release()


async def test_put_rejects_wrong_size_and_unknown_tier(knobs):
    async with TierManager(two_tiers(), knobs=knobs) as m:
        with pytest.raises(ValueError, match="exactly 4096"):
            await m.put(key(1), torch.zeros(10, dtype=torch.uint8))
        with pytest.raises(ValueError, match="tier='ssd'.*gpu, cpu"):
            await m.put(key(1), block(1), tier="ssd")


async def test_full_of_protected_blocks_raises_budget_exceeded(knobs):
    async with TierManager([CpuTier(BLOCK, 3 * BLOCK)], knobs=knobs) as m:
        for i in range(3):
            await m.put(key(i), block(i))
        with pytest.raises(BudgetExceeded, match="cpu"):
            await m.put(key(9), block(9))
        m.unprotect([key(0)])
        await m.put(key(9), block(9))  # the unprotected block makes room
        assert not m.contains(key(0)) and m.contains(key(9))
        assert_quiescent(m)


async def test_missing_block_and_closed_manager(knobs):
    m = TierManager(two_tiers(), knobs=knobs)
    with pytest.raises(ManagerClosed):
        await m.acquire([key(1)])
    await m.start()
    with pytest.raises(BlockMissing, match="not stored"):
        await m.acquire([key(1)])
    await m.aclose()
    await m.aclose()  # idempotent
    with pytest.raises(ManagerClosed):
        await m.put(key(1), block(1))


async def test_pinned_blocks_are_not_evicted(knobs):
    async with TierManager(two_tiers(gpu_slots=2), knobs=knobs) as m:
        await m.put(key(0), block(0), tier="gpu")
        lease = await m.acquire([key(0)], "gpu")
        for i in range(1, 6):
            await m.put(key(i), block(i), tier="gpu")
        assert "gpu" in m.where(key(0))
        assert torch.equal(lease.views[0], block(0))
        lease.release()
        assert_quiescent(m)


async def test_stress_budgets_never_exceeded(knobs):
    """Thousands of concurrent put/acquire/prefetch ops over three small tiers."""
    tiers = [GpuTier(BLOCK, 8 * BLOCK), CpuTier(BLOCK, 24 * BLOCK), SlowTier("cxl", Medium.CXL, 200, 0.0)]
    rng = random.Random(7)
    async with TierManager(tiers, knobs=knobs) as m:
        peaks = []

        async def worker(w: int) -> None:
            for step in range(150):
                i = rng.randrange(120)
                op = rng.random()
                if not m.contains(key(i)) and key(i) not in m.directory:
                    await m.put(key(i), block(i))
                elif op < 0.2:
                    m.prefetch([key(i), key((i + 1) % 120)], "gpu")
                elif m.contains(key(i)):
                    try:
                        lease = await m.acquire([key(i)], rng.choice(["gpu", "cpu", None]))
                    except BlockMissing:
                        continue  # not yet committed by another worker
                    assert torch.equal(lease.views[0], block(i))
                    lease.release()
                peaks.append(tuple(t.pool.used for t in m.tiers.values()))
                if step % 10 == 0:
                    await asyncio.sleep(0)

        await asyncio.gather(*(worker(w) for w in range(20)))
        await m.flush()
        assert len(peaks) == 3000
        caps = tuple(t.pool.capacity for t in m.tiers.values())
        assert all(p <= c for used in peaks for p, c in zip(used, caps))
        assert all(t.allocated_bytes <= t.budget_bytes for t in m.tiers.values())
        assert_quiescent(m)


async def test_cancelled_waiter_leaks_nothing(knobs):
    tiers = [CpuTier(BLOCK, 4 * BLOCK), SlowTier("cxl", Medium.CXL, 16, 0.05)]
    async with TierManager(tiers, knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), tier="cxl")
        task = asyncio.create_task(m.acquire([key(i) for i in range(4)], "cpu"))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while m._executor.busy:
            await m._executor.progress()
        assert_quiescent(m)
        lease = await m.acquire([key(0)], "cpu")  # the cancelled load still completed
        assert torch.equal(lease.views[0], block(0))
        lease.release()


async def test_a_put_cancelled_while_it_writes_frees_its_slot_only_once_the_write_is_over(knobs):
    """A slot freed under a running write could be given to another block and then overwritten."""
    slow = SlowTier("cxl", Medium.CXL, 4, 0.2)
    async with TierManager([CpuTier(BLOCK, 4 * BLOCK), slow], knobs=knobs) as m:
        task = asyncio.create_task(m.put(key(0), block(0), tier="cxl"))
        while not m._executor._running:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert m._executor._running and slow.pool.used == 1     # the write runs on: its slot stays taken
        while m._executor.busy:
            await m._executor.progress()
        for _ in range(10):                                      # freed by the write's completion
            await asyncio.sleep(0)
        assert slow.pool.used == 0 and not m.contains(key(0))
        assert_quiescent(m)


async def test_close_with_queued_transfers_leaks_nothing(knobs):
    tiers = [CpuTier(BLOCK, 32 * BLOCK), SlowTier("cxl", Medium.CXL, 32, 0.02)]
    m = await TierManager(tiers, knobs=knobs).start()
    for i in range(30):
        await m.put(key(i), block(i), tier="cxl")
    for i in range(30):
        m.prefetch([key(i)], "cpu")
    await asyncio.sleep(0.03)
    assert m._executor.queued > 0
    await m.aclose()
    assert_quiescent(m)
    assert any(e.error == "ManagerClosed" for e in m.events.events) or m._executor.queued == 0


async def test_loads_beat_prefetch_beat_writeback(knobs):
    """One worker thread, a blocking first job: the queue drains in priority order."""
    from tierkv.knobs import IOKnobs
    one = IOKnobs(copy_threads=1, inflight_bytes=BLOCK)
    tiers = [CpuTier(BLOCK, 32 * BLOCK), SlowTier("cxl", Medium.CXL, 32, 0.01)]
    async with TierManager(tiers, knobs=one) as m:
        for i in range(8):
            await m.put(key(i), block(i), tier="cxl")
        m.prefetch([key(0)], "cpu")          # occupies the only worker
        await asyncio.sleep(0)
        m.prefetch([key(1)], "cpu")
        m.prefetch([key(2)], "cpu")
        await asyncio.sleep(0)
        lease = await m.acquire([key(3)], "cpu")
        lease.release()
        await m.flush()
        order = [e.kind for e in m.events.of_kind("load", "prefetch")]
        assert order.index("load") < 2, order  # jumped ahead of queued prefetches


async def test_waiting_on_a_queued_prefetch_boosts_it(knobs):
    from tierkv.knobs import IOKnobs
    one = IOKnobs(copy_threads=1, inflight_bytes=BLOCK)
    tiers = [CpuTier(BLOCK, 32 * BLOCK), SlowTier("cxl", Medium.CXL, 32, 0.01)]
    async with TierManager(tiers, knobs=one) as m:
        for i in range(12):
            await m.put(key(i), block(i), tier="cxl")
        for i in range(10):
            m.prefetch([key(i)], "cpu")
        await asyncio.sleep(0)
        lease = await m.acquire([key(9)], "cpu")
        lease.release()
        done_before = [e for e in m.events.of_kind("prefetch")]
        await m.flush()
        assert len(done_before) < 9  # key 9's move ran before most earlier prefetches
        assert_quiescent(m)


async def test_events_and_waits_are_recorded(knobs):
    async with TierManager(two_tiers(), knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), tier="cpu", layer=3)
        lease = await m.acquire([key(i) for i in range(4)], "gpu", layer=3)
        lease.release()
        loads = m.events.of_kind("load")
        assert loads and loads[0].src == "cpu" and loads[0].dst == "gpu" and loads[0].layer == 3
        assert sum(e.nbytes for e in loads) == 4 * BLOCK
        assert all(e.submit <= e.start <= e.done for e in m.events.events)
        assert m.events.of_kind("wait")[0].nbytes == 4 * BLOCK


def test_a_wait_is_the_waiting_thread_s_recording_or_not(knobs):
    """Answers decoded side by side take their stalls from their own threads' waits: an acquire's wait,
    recorded on the loop's thread, is the caller's; and it counts while events are not recorded (a
    document read meanwhile turns recording off)."""
    import threading

    from tierkv.manager import BlockingTierManager
    with BlockingTierManager(TierManager(two_tiers(), knobs=knobs)) as m:
        for i in range(8):
            m.put(key(i), block(i), tier="cpu")
        events, waited = m.manager.events, {}
        events.enabled = False
        events.clear()

        def acquire(name: str, keys: list) -> None:
            m.acquire(keys, "gpu").release()
            waited[name] = events.waited()
        other = threading.Thread(target=acquire, args=("other", [key(i) for i in range(4)]))
        other.start()
        other.join()
        assert waited["other"] > 0 and events.waited() == 0 and not events.events
        acquire("this", [key(i) for i in range(4, 8)])
        assert 0 < waited["this"] and events.waited() == waited["this"]


def test_blocking_facade(knobs):
    from tierkv.manager import BlockingTierManager
    with BlockingTierManager(TierManager(two_tiers(), knobs=knobs)) as m:
        for i in range(10):
            m.put(key(i), block(i))
        with m.blocks([key(0), key(9)], "gpu") as views:
            assert torch.equal(views[0], block(0)) and torch.equal(views[1], block(9))
        m.prefetch([key(1)], "gpu")
        m.flush()
        assert m.contains(key(1))
        assert_quiescent(m.manager)


async def test_an_unused_prefetch_is_evicted_before_blocks_in_use(knobs):
    """A guessed prefetch enters the tier cold, so the next load evicts it before
    blocks a reader used, however long ago; once read, it ranks like any other block."""
    async with TierManager(two_tiers(gpu_slots=4), knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), tier="cpu")
        for i in range(3):                                  # in use: read into the gpu tier
            (await m.acquire([key(i)], "gpu")).release()
        m.prefetch([key(3)], "gpu", guess=True)             # the guess fills the last slot
        await m.flush()
        assert "gpu" in m.where(key(3))
        (await m.acquire([key(4)], "gpu")).release()        # needs room: the guess goes, not key 0
        assert "gpu" not in m.where(key(3))
        assert all("gpu" in m.where(key(i)) for i in (0, 1, 2, 4))

        m.prefetch([key(5)], "gpu", guess=True)
        await m.flush()
        lease = await m.acquire([key(5)], "gpu")            # read: no longer a guess
        assert torch.equal(lease.views[0], block(5))
        lease.release()
        (await m.acquire([key(6)], "gpu")).release()        # evicts the oldest use, key 0
        assert "gpu" not in m.where(key(0)) and "gpu" in m.where(key(5))
        assert_quiescent(m)


async def test_a_certain_prefetch_ranks_as_used(knobs):
    """Without ``guess`` (a reader will use the blocks: the next group, the next layer) a
    prefetched block is inserted like a read one: the oldest use goes first."""
    async with TierManager(two_tiers(gpu_slots=4), knobs=knobs) as m:
        for i in range(8):
            await m.put(key(i), block(i), tier="cpu")
        for i in range(3):
            (await m.acquire([key(i)], "gpu")).release()
        m.prefetch([key(3)], "gpu")
        await m.flush()
        (await m.acquire([key(4)], "gpu")).release()
        assert "gpu" not in m.where(key(0)) and "gpu" in m.where(key(3))
        assert not m.directory.cold
        assert_quiescent(m)


async def test_a_block_two_sequences_hold_is_freed_when_the_last_lets_go(knobs):
    async with TierManager(two_tiers(), knobs=knobs) as m:
        await m.put(key(1), block(1))              # sequence A holds it
        await m.put(key(1), block(1))              # sequence B seals the same content: one copy, two holders
        await m.put(key(2), block(2))
        assert m.protect([key(2)]) and not m.protect([key(2), key(9)])   # all or none
        assert m.tiers["gpu"].pool.used == 2 and m.directory.get(key(1)).holders == 2
        await m.drop([key(1)])                     # A lets go: B still holds it
        assert m.where(key(1)) == ["gpu"] and m.directory.get(key(1)).protected
        await m.drop([key(1)])                     # B lets go: freed
        assert m.where(key(1)) == [] and m.tiers["gpu"].pool.used == 1
        m.unprotect([key(2)])
        assert m.directory.get(key(2)).holders == 1
        assert_quiescent(m)


async def test_holds_in_bulk_count_each_naming_and_never_go_below_none(knobs):
    """A stored document's pages are held and let go of in a few numpy passes: a key named twice is
    held twice, an unknown key is returned, and letting go more often than held stops at no holder."""
    async with TierManager(two_tiers(gpu_slots=4, cpu_slots=16), knobs=knobs) as m:
        for i in (1, 2):
            await m.put(key(i), block(i))
        m.unprotect([key(1), key(2)])
        assert m.hold([key(1), key(1), key(9), key(2)]) == [key(9)]
        assert [m.directory.get(key(i)).holders for i in (1, 2)] == [2, 1]
        m.unprotect([key(1), key(2), key(2), key(2), key(9)])
        assert [m.directory.get(key(i)).holders for i in (1, 2)] == [1, 0]
        many = [key(1000 + i) for i in range(20_000)]
        assert m.hold([*many[:10], key(1), *many[10:]]) == many
        assert m.directory.get(key(1)).holders == 2
        assert_quiescent(m)


def test_the_blocking_facade_from_several_threads(knobs):
    """Eight threads put, read, prefetch and let go of their own blocks and read shared ones through one
    facade, over a gpu tier of 24 blocks (room for every reader at once; moves all the time): every
    read is its block's bytes."""
    import threading
    from tierkv.manager import BlockingTierManager
    errors: list[BaseException] = []
    with BlockingTierManager(TierManager(two_tiers(gpu_slots=24, cpu_slots=192), knobs=knobs)) as m:
        for i in range(8):
            m.put(key(1000 + i), block(1000 + i))               # shared, held for the whole test

        def work(t: int) -> None:
            rng = random.Random(t)
            try:
                mine = [key(100 * t + i) for i in range(20)]
                for i, k in enumerate(mine):
                    m.put(k, block(100 * t + i))
                for _ in range(60):
                    i, shared = rng.randrange(20), 1000 + rng.randrange(8)
                    with m.blocks([mine[i], key(shared)], "gpu" if rng.random() < 0.5 else None) as views:
                        assert torch.equal(views[0], block(100 * t + i)) and torch.equal(views[1], block(shared))
                    if rng.random() < 0.2:
                        m.prefetch([mine[rng.randrange(20)]], "gpu")
                m.unprotect(mine)
            except BaseException as error:     # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors[0]
        assert not any(thread.is_alive() for thread in threads)
        m.flush()
        assert_quiescent(m.manager)


class HeldGpu(GpuTier):
    """A gpu tier whose host-to-host copies out wait for ``go`` (set by the test) once ``go`` is armed."""

    go = None

    def copy_slots(self, slots, dst, dst_slots):
        if self.go is not None:
            self.started.set()
            assert self.go.wait(10)
        super().copy_slots(slots, dst, dst_slots)


async def test_a_block_pinned_while_it_is_demoted_keeps_its_copy_and_the_others_go(knobs):
    """A demotion's blocks leave their tier once copied below, but one that a reader pinned while the
    copy ran stays there too (its policy knows it again); every block reads back whole."""
    gpu = HeldGpu(BLOCK, 4 * BLOCK)
    gpu.started, gpu.go = threading.Event(), None
    async with TierManager([gpu, CpuTier(BLOCK, 16 * BLOCK)], knobs=knobs) as m:
        for i in range(7):
            await m.put(key(i), block(i))                       # 0..3 in the gpu tier, the rest below
        gpu.go = threading.Event()
        room = asyncio.ensure_future(m.acquire([key(4), key(5), key(6)], "gpu"))   # demotes 0, 1, 2
        assert await asyncio.to_thread(gpu.started.wait, 10)
        reader = await m.acquire([key(1)], "gpu")               # pinned while it is copied below
        gpu.go.set()
        (await asyncio.wait_for(room, 20)).release()
        assert m.where(key(0)) == ["cpu"] and m.where(key(2)) == ["cpu"]
        assert sorted(m.where(key(1))) == ["cpu", "gpu"]
        assert torch.equal(reader.views[0], block(1))
        reader.release()
        gpu.go = None
        for i in range(7):
            lease = await m.acquire([key(i)])
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert key(1) in m.policies["gpu"]._order
        assert_quiescent(m)


async def test_only_copies_evicted_beyond_what_the_tier_below_holds_go_further_down(tmp_path, knobs):
    """A load evicts more protected blocks, held nowhere else, than the tier below can hold at all: those
    that fit go down one tier, the rest to the store, none lost and no BudgetExceeded for the reader."""
    tiers = [GpuTier(BLOCK, 4 * BLOCK), CpuTier(BLOCK, 1 * BLOCK), NvmeTier(tmp_path / "s", BLOCK, 64 * BLOCK)]
    async with TierManager(tiers, knobs=knobs) as m:
        for i in range(4):
            await m.put(key(i), block(i), tier="gpu")                  # only copies, held
        for i in range(4, 7):
            await m.put(key(i), block(i), tier="nvme")
        lease = await m.acquire([key(4), key(5), key(6)], "gpu")      # three of the four must leave the gpu tier
        assert all(torch.equal(view, block(i)) for view, i in zip(lease.views, (4, 5, 6)))
        lease.release()
        for i in range(4):
            lease = await m.acquire([key(i)], "cpu")
            assert torch.equal(lease.views[0], block(i))
            lease.release()
        assert_quiescent(m)
