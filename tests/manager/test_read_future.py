"""ReadFuture: the blocks in place are copied at once, the rest when they arrive; one read, one shape."""
import asyncio
import concurrent.futures
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tierkv.errors import BlockMissing, ManagerClosed
from tierkv.manager import BlockingTierManager, TierManager
from tierkv.manager.lease import Lease, Lent, Watched
from tierkv.manager.read_future import thread_future
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.memory import HostSpace
from tierkv.tiers.nvme import NvmeTier

from conftest import BLOCK, assert_quiescent, block, key


def manager(path, knobs, gpu=4, cpu=4) -> BlockingTierManager:
    tiers = [GpuTier(BLOCK, gpu * BLOCK), CpuTier(BLOCK, cpu * BLOCK), NvmeTier(path, BLOCK, 256 * BLOCK)]
    return BlockingTierManager(TierManager(tiers, knobs=knobs))


def stored(mgr: BlockingTierManager, n: int) -> list:
    """n protected blocks, put in turn: the fastest tier's free slots take them first, then the next's."""
    keys = [key(i) for i in range(n)]
    for i, k in enumerate(keys):
        mgr.put(k, block(i))
    return keys


@contextmanager
def churning(mgr: BlockingTierManager, keys: list) -> Iterator[None]:
    """Another thread keeps loading random blocks into the gpu tier (its slots freed and reused) meanwhile."""
    stop = threading.Event()

    def churn() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            mgr.acquire(rng.sample(keys, 3), tier="gpu").release()
            stop.wait(0.001)        # (a tight loop starves the reads it churns under, on a loaded machine)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        yield
    finally:
        stop.set()
        churner.join()


class Interrupted(BaseException):
    pass


async def test_the_thread_future_of_a_cancelled_load_is_done_and_raises():
    """A thread waiting on a load whose task was cancelled is woken, not left waiting for ever."""
    task = asyncio.ensure_future(asyncio.sleep(10))
    out = thread_future(task)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    with pytest.raises(concurrent.futures.CancelledError):
        out.result(timeout=0)


def settle(mgr: BlockingTierManager, key) -> None:
    """Wait until no slot is pinned or reserved: a release runs on the loop once its load is done."""
    deadline = time.monotonic() + 10
    while any(t.pool.busy_slots() for t in mgr.manager.tiers.values()) and time.monotonic() < deadline:
        mgr.contains(key)
        time.sleep(0.01)


def test_blocks_in_place_are_copied_at_once_and_the_rest_on_wait(tmp_path, knobs):
    with manager(tmp_path / "s", knobs) as mgr:
        keys = stored(mgr, 12)
        only_on_disk = [i for i, k in enumerate(keys) if mgr.where(k) == ["nvme"]]
        assert only_on_disk and len(only_on_disk) < len(keys)
        out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
        future = mgr.read(keys, into=out, layer=3)
        assert future.missing == only_on_disk
        assert future.ready == [i for i in range(len(keys)) if i not in only_on_disk]
        for i in range(len(keys)):
            assert torch.equal(out[i], block(i)) != (i in only_on_disk)
        waits = len(mgr.manager.events.of_kind("wait"))
        future.wait()
        assert all(torch.equal(out[i], block(i)) for i in range(len(keys)))
        stall = mgr.manager.events.of_kind("wait")[waits:]
        assert [(e.layer, e.blocks) for e in stall] == [(3, len(only_on_disk))]   # one stall, the caller's
        assert future.wait() is out                                            # a second wait: nothing to do
        mgr.contains(keys[0])                                                     # the unpins have run
        assert_quiescent(mgr.manager)


def test_a_packed_read_gives_each_tier_a_run_of_rows_and_the_missing_ones_the_last(tmp_path, knobs):
    """``packed``: the blocks in place take the first rows of ``into``, a run per tier in the order the
    keys name them, the loading ones the rows after; ``placed`` says where each key went."""
    with manager(tmp_path / "s", knobs) as mgr:
        keys = stored(mgr, 12)
        tiers = [mgr.where(k)[0] for k in keys]
        assert {"gpu", "cpu", "nvme"} <= set(tiers)
        order = [1, 0, 11, 2, 10, 3, 9, 4, 8, 5, 7, 6]          # the tiers interleaved
        asked = [keys[i] for i in order]
        out = torch.zeros(len(asked), BLOCK, dtype=torch.uint8)
        future = mgr.read(asked, into=out, packed=True)
        placed = future.placed.tolist()
        assert sorted(placed) == list(range(len(asked)))
        first = [tiers[order[i]] for i in range(len(asked))]
        runs = [[placed[i] for i in range(len(asked)) if first[i] == name] for name in dict.fromkeys(first)
                if name != "nvme"]
        for run in runs:                                        # each tier's keys: a run, in the keys' order
            assert run == list(range(run[0], run[0] + len(run)))
        assert [placed[i] for i in future.missing] == list(range(len(future.ready), len(asked)))
        for i in future.ready:
            assert torch.equal(out[placed[i]], block(order[i]))
        future.wait()
        assert all(torch.equal(out[placed[i]], block(order[i])) for i in range(len(asked)))
        assert mgr.read(keys[-2:], into=out[:2], packed=True).placed is None   # one tier, nothing loading
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_everything_in_place_leaves_nothing_to_wait_for(tmp_path, knobs):
    with manager(tmp_path / "s", knobs, gpu=16) as mgr:
        keys = stored(mgr, 8)
        out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
        future = mgr.read(keys, into=out)
        assert future.missing == [] and all(torch.equal(out[i], block(i)) for i in range(8))
        future.wait()
        assert not mgr.manager.events.of_kind("wait")
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_a_read_that_may_lend_lends_blocks_in_one_extent_and_copies_otherwise(tmp_path, knobs):
    with manager(tmp_path / "s", knobs, gpu=16) as mgr:
        keys = stored(mgr, 8)
        out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
        future = mgr.read(keys, into=out, lend=True)
        assert future.missing == [] and future.lease is not None and not out.any()     # nothing copied
        extent, rows = future.extent
        assert all(torch.equal(extent[row], block(i)) for i, row in enumerate(rows.tolist()))
        gpu = mgr.manager.tiers["gpu"].pool
        assert gpu.busy_slots() == len(keys)                     # pinned while lent
        future.lease.release()
        mgr.contains(keys[0])                                    # the unpins have run
        assert_quiescent(mgr.manager)
    with manager(tmp_path / "t", knobs) as mgr:                  # some blocks only on disk: copied as usual
        keys = stored(mgr, 12)
        out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
        future = mgr.read(keys, into=out, lend=True)
        assert future.missing and future.lease is None and future.extent is None
        future.wait()
        assert all(torch.equal(out[i], block(i)) for i in range(len(keys)))
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_a_cancelled_read_releases_its_blocks_when_they_arrive(tmp_path, knobs):
    with manager(tmp_path / "s", knobs) as mgr:
        keys = stored(mgr, 12)
        future = mgr.read(keys, into=torch.zeros(len(keys), BLOCK, dtype=torch.uint8))
        pending = future._pending
        future.cancel()
        pending.result(timeout=30)
        settle(mgr, keys[0])
        assert_quiescent(mgr.manager)
        future.wait()                    # cancelled: nothing left to copy
        assert future.done()


def test_an_interrupted_wait_releases_the_blocks_when_they_arrive(tmp_path, knobs):
    with manager(tmp_path / "s", knobs) as mgr:
        keys = stored(mgr, 12)
        future = mgr.read(keys, into=torch.zeros(len(keys), BLOCK, dtype=torch.uint8))
        pending = future._pending
        arrived = pending.result

        def interrupted(timeout=None):
            pending.result = arrived
            raise Interrupted      # as KeyboardInterrupt would, which pytest takes for its own
        pending.result = interrupted
        with pytest.raises(Interrupted):
            future.wait()
        arrived(timeout=30)
        settle(mgr, keys[0])
        assert_quiescent(mgr.manager)


def test_a_wait_interrupted_after_its_blocks_arrived_releases_them(tmp_path, knobs, monkeypatch):
    """The lease has arrived and ``wait`` is interrupted before the copy: its pins go with it."""
    with manager(tmp_path / "s", knobs) as mgr:
        keys = stored(mgr, 12)
        future = mgr.read(keys, into=torch.zeros(len(keys), BLOCK, dtype=torch.uint8))
        future._pending.result(timeout=30)

        def interrupted(*args, **kwargs):
            raise Interrupted
        monkeypatch.setattr(mgr.manager.events, "wait", interrupted)
        with pytest.raises(Interrupted):
            future.wait()
        settle(mgr, keys[0])
        assert_quiescent(mgr.manager)


def test_a_plain_read_waits_for_every_row_and_raises_for_a_block_stored_nowhere(tmp_path, knobs):
    with manager(tmp_path / "s", knobs) as mgr:
        keys = stored(mgr, 12)
        out = mgr.read(keys, into=torch.zeros(len(keys), BLOCK, dtype=torch.uint8)).wait()
        assert all(torch.equal(out[i], block(i)) for i in range(len(keys)))
        future = mgr.read([keys[0], key(999)], into=torch.zeros(2, BLOCK, dtype=torch.uint8))
        with pytest.raises(BlockMissing):
            future.wait()
        settle(mgr, keys[0])
        assert_quiescent(mgr.manager)


def test_a_read_lent_unpinned_pins_nothing_and_says_whether_its_blocks_stayed(tmp_path, knobs):
    with manager(tmp_path / "s", knobs, gpu=16) as mgr:
        keys = stored(mgr, 9)
        out = torch.zeros(8, BLOCK, dtype=torch.uint8)
        hits = len(mgr.manager.events.of_kind("hit"))
        future = mgr.read(keys[:8], into=out, lend=True, pin=False, layer=2)
        assert isinstance(future.lease, Lent) and future.missing == [] and not out.any()
        extent, rows = future.extent
        assert all(torch.equal(extent[row], block(i)) for i, row in enumerate(rows.tolist()))
        assert mgr.manager.tiers["gpu"].pool.busy_slots() == 0          # nothing pinned

        def hit_events() -> list:
            return [(e.layer, e.blocks) for e in mgr.manager.events.of_kind("hit")[hits:]]
        assert hit_events() == []                                       # hits once the check has passed
        assert future.lease.release() and hit_events() == [(2, 8)]      # nothing moved meanwhile
        assert future.lease.release() and hit_events() == [(2, 8)]      # (counted once)
        order = mgr.manager.policies["gpu"]._order
        mgr.contains(keys[0])                                           # the loop told the policy
        assert list(order)[-8:] == keys[:8]

        future = mgr.read(keys[:8], into=out, lend=True, pin=False, layer=3)
        mgr.drop([keys[8]])                                             # a slot of the tier freed meanwhile
        assert not future.lease.release()                               # what was read may be another block
        assert hit_events() == [(2, 8)]                                 # read again pinned: no hit counted twice
        assert_quiescent(mgr.manager)
    with manager(tmp_path / "t", knobs) as mgr:                         # some only on disk: the pinned read
        keys = stored(mgr, 12)
        out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
        future = mgr.read(keys, into=out, lend=True, pin=False)
        assert future.missing and future.lease is None
        future.wait()
        assert all(torch.equal(out[i], block(i)) for i in range(len(keys)))
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_an_unpinned_read_looks_its_keys_up_without_writing_what_the_key_table_remembers(tmp_path, knobs):
    """The loop alone writes the key table's memories: an answer written on the caller's thread while the
    loop removed its key would outlive the removal, and could name the row another block takes later."""
    with manager(tmp_path / "s", knobs, gpu=16) as mgr:
        keys = stored(mgr, 14)
        table = mgr.manager.directory._table
        mgr.call(table._hot.clear)
        mgr.call(table._recent.clear)
        out = torch.zeros(14, BLOCK, dtype=torch.uint8)
        for asked in (keys[:12], keys[:5], keys):                     # a batch, a few keys one by one, all
            future = mgr.read(asked, into=out[:len(asked)], lend=True, pin=False)
            assert isinstance(future.lease, Lent) and future.lease.release()
        assert not table._hot and not table._recent
        assert_quiescent(mgr.manager)


@pytest.mark.parametrize("how", ["lend", "packed"])
def test_a_row_given_to_another_block_under_an_unpinned_lookup_is_not_read_as_the_first(tmp_path, knobs, how):
    """The caller finds a block's row; before it reads the row's slots, the loop lets the block go (its
    last copy was in another tier) and gives the row to a new block, put into a slot of the tier read
    that was free already: no slot of that tier is freed, so its epoch and generations stay as they
    were. The row is checked again once its slots are read, and the read goes pinned."""
    with manager(tmp_path / "s", knobs) as mgr:
        for i in range(4):
            mgr.put(key(i), block(i))
        gone, newcomer = key(10), key(11)
        mgr.put(gone, block(10))                       # in the cpu tier alone
        for i in range(20, 24):
            mgr.put(key(i), block(i))                  # the cpu tier's other slots, then one on disk alone
        assert mgr.where(gone) == ["cpu"] and mgr.where(key(23)) == ["nvme"]
        mgr.drop([key(0)])                             # a gpu slot free before the read starts
        directory = mgr.manager.directory
        lookup, swapped = directory.rows, []

        def rows(keys, guesses=None, *, off_loop=False):
            found = lookup(keys, guesses, off_loop=off_loop)
            if threading.current_thread().name != "tierkv-loop" and not swapped:
                swapped.append(found)                  # here, the loop runs before the caller goes on:
                mgr.drop([gone])                       # the block's row is let go of ...
                mgr.put(newcomer, block(11))           # ... and taken by a new block, in the free gpu slot
            return found

        directory.rows = rows
        out = torch.zeros(2, BLOCK, dtype=torch.uint8)
        if how == "lend":
            future = mgr.read([gone], into=out[:1], lend=True, pin=False)
        else:                                          # (one block on disk: the read splits, copying here)
            future = mgr.read([gone, key(23)], into=out, packed=True, pin=False, tier="gpu")
        directory.rows = lookup
        assert swapped and mgr.rows([newcomer])[0] == swapped[0][0]      # the row did change hands
        assert not isinstance(future.lease, Lent)
        with pytest.raises(BlockMissing):              # the pinned read: the block is stored nowhere now
            future.wait()
        assert not any(torch.equal(row, block(11)) for row in out)
        assert_quiescent(mgr.manager)


def test_blocks_lent_unpinned_that_stayed_put_are_the_blocks_asked_for(tmp_path, knobs):
    """A reader lends blocks unpinned while another thread keeps evicting the tier they lie in: every
    read whose lease says the blocks stayed put holds exactly them."""
    with manager(tmp_path / "s", knobs, gpu=6, cpu=64) as mgr:
        keys = stored(mgr, 24)
        rng, kept, moved = random.Random(2), 0, 0
        with churning(mgr, keys):
            deadline = time.monotonic() + 30
            while (kept < 50 or moved < 5) and time.monotonic() < deadline:
                asked = rng.sample(range(len(keys)), 2)
                future = mgr.read([keys[i] for i in asked], into=torch.zeros(2, BLOCK, dtype=torch.uint8),
                                  lend=True, pin=False, tier="gpu")
                if not isinstance(future.lease, Lent):
                    if future.lease is not None:
                        future.lease.release()
                    future.wait()
                    continue
                extent, rows = future.extent
                got = extent[torch.from_numpy(rows)].clone()
                if future.lease.release():
                    kept += 1
                    assert all(torch.equal(got[j], block(i)) for j, i in enumerate(asked))
                else:
                    moved += 1
        assert kept >= 50 and moved >= 5
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_a_packed_read_unpinned_copies_the_blocks_in_memory_here_and_loads_the_rest(tmp_path, knobs):
    """``read(..., pin=False, packed=True)`` with some blocks only on disk: those in memory are copied on
    the caller's thread, unpinned, a run per tier; the missing ones load while it goes on."""
    with manager(tmp_path / "s", knobs, gpu=8, cpu=8) as mgr:
        keys = stored(mgr, 20)
        tiers = [mgr.where(k)[0] for k in keys]
        assert tiers == ["gpu"] * 8 + ["cpu"] * 8 + ["nvme"] * 4
        # the newer half of each memory tier and the blocks on disk: the load's room is made of the older
        # halves, untouched, so no slot copied from is freed under the copy (that would send it pinned)
        order = [5, 4, 19, 6, 18, 7, 17, 12, 16, 13, 15, 14]
        asked = [keys[i] for i in order]
        out = torch.zeros(len(asked), BLOCK, dtype=torch.uint8)
        hits = len(mgr.manager.events.of_kind("hit"))
        future = mgr.read(asked, into=out, pin=False, packed=True, layer=5)
        assert future.lease is None and [tiers[order[i]] for i in future.missing] == ["nvme"] * 4
        placed = future.placed.tolist()
        for name in ("gpu", "cpu"):                       # each tier's blocks: a run of rows, in the keys' order
            run = [placed[i] for i in range(len(asked)) if tiers[order[i]] == name]
            assert run and run == list(range(run[0], run[0] + len(run)))
        assert [placed[i] for i in future.missing] == list(range(len(future.ready), len(asked)))
        assert all(torch.equal(out[placed[i]], block(order[i])) for i in future.ready)
        assert sorted((e.src, e.blocks) for e in mgr.manager.events.of_kind("hit")[hits:]) == [("cpu", 4), ("gpu", 4)]
        future.wait()
        assert all(torch.equal(out[placed[i]], block(order[i])) for i in range(len(asked)))
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_packed_reads_unpinned_beside_evictions_give_the_blocks_asked_for(tmp_path, knobs):
    """Packed reads unpinned while another thread keeps loading blocks into the tier they copy from (so
    its slots are freed and reused under them): every row read is its block's."""
    with manager(tmp_path / "s", knobs, gpu=16, cpu=16) as mgr:
        keys = stored(mgr, 48)
        rng, split = random.Random(2), 0
        with churning(mgr, keys):
            for _ in range(300):
                asked = rng.sample(range(len(keys)), 6)
                out = torch.zeros(len(asked), BLOCK, dtype=torch.uint8)
                future = mgr.read([keys[i] for i in asked], into=out, pin=False, packed=True, tier="gpu")
                split += bool(future.missing)
                future.wait()
                rows = range(len(asked)) if future.placed is None else future.placed.tolist()
                assert all(torch.equal(out[row], block(i)) for row, i in zip(rows, asked))
        assert split > 100
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


class HookedGpu(GpuTier):
    """A gpu tier that calls ``before_gather()`` (when set) as a caller starts copying blocks out."""

    before_gather = None

    def gather(self, slots, out, rows=None):
        if self.before_gather is not None:
            self.before_gather()
        super().gather(slots, out, rows)


def hooked(path, knobs) -> tuple[BlockingTierManager, HookedGpu, list]:
    """A gpu tier of 4 slots holding blocks 0..3 (0, 1 the oldest), 4..7 in the cpu tier."""
    gpu = HookedGpu(BLOCK, 4 * BLOCK)
    mgr = BlockingTierManager(TierManager([gpu, CpuTier(BLOCK, 8 * BLOCK), NvmeTier(path, BLOCK, 64 * BLOCK)],
                                          knobs=knobs))
    keys = [key(i) for i in range(8)]
    for i, k in enumerate(keys):
        mgr.put(k, block(i))
    assert [mgr.where(k)[0] for k in keys] == ["gpu"] * 4 + ["cpu"] * 4
    return mgr, gpu, keys


def wait_until(done) -> None:
    deadline = time.monotonic() + 10
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert done()


def test_an_unpinned_read_s_own_load_starts_first_and_evicts_other_blocks_than_it_copies(tmp_path, knobs):
    """A packed read unpinned sends its load before it copies; the load's evictions (free slots of the
    very tier copied from) leave the copy standing: its blocks are touched first, so others go, and
    only the slots copied from are checked."""
    mgr, gpu, keys = hooked(tmp_path / "s", knobs)
    with mgr:
        asked = [keys[0], keys[1], keys[4], keys[5]]                   # 0, 1 in the gpu tier, the oldest; 4, 5 load
        # the copy waits for the load to land: it evicted blocks of the tier meanwhile (2 and 3)
        gpu.before_gather = lambda: wait_until(lambda: mgr.where(keys[4])[0] == mgr.where(keys[5])[0] == "gpu")
        out = torch.zeros(len(asked), BLOCK, dtype=torch.uint8)
        future = mgr.read(asked, into=out, pin=False, packed=True, tier="gpu")
        gpu.before_gather = None
        assert future.rows is not None and future.missing == [2, 3]    # the unpinned read, not the pinned one
        assert [mgr.where(k)[0] for k in keys[2:4]] == ["cpu", "cpu"]   # what the load evicted
        future.wait()
        assert all(torch.equal(out[row], block(i)) for row, i in zip(future.placed.tolist(), (0, 1, 4, 5)))
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def read_2_3_4_pinned_again(mgr: BlockingTierManager, keys: list) -> None:
    """Read blocks 2, 3 (in the gpu tier of ``hooked``) and 4 (to load) unpinned, where something evicts 2
    and 3 on the way: the read is the pinned one, and every row is its block."""
    asked = [keys[2], keys[3], keys[4]]
    out = torch.zeros(len(asked), BLOCK, dtype=torch.uint8)
    future = mgr.read(asked, into=out, pin=False, packed=True, tier="gpu")
    assert future.rows is None                                     # the pinned read
    future.wait()
    rows = range(len(asked)) if future.placed is None else future.placed.tolist()
    assert all(torch.equal(out[row], block(i)) for row, i in zip(rows, (2, 3, 4)))
    mgr.contains(keys[0])
    assert_quiescent(mgr.manager)


def evict_2_and_3(mgr: BlockingTierManager, keys: list) -> None:
    """Three other blocks take every slot of ``hooked``'s gpu tier that a load of block 4 leaves."""
    mgr.acquire([keys[5], keys[6], keys[7]], tier="gpu").release()


def test_a_block_evicted_while_it_is_copied_unpinned_is_read_again_pinned(tmp_path, knobs):
    """A packed read unpinned whose blocks are evicted and their slots given to others while it copies
    them (its checks of the slots' generations) reads them again, pinned: every row is its block."""
    mgr, gpu, keys = hooked(tmp_path / "s", knobs)
    with mgr:
        def evict() -> None:
            gpu.before_gather = None
            evict_2_and_3(mgr, keys)
        gpu.before_gather = evict
        read_2_3_4_pinned_again(mgr, keys)


def test_blocks_evicted_between_the_lookup_and_the_noting_of_their_generations_are_read_pinned(tmp_path, knobs):
    """Blocks evicted, and their slots given to others, right after an unpinned read looked them up and
    before it noted their slots' generations (which then count the new blocks): the pool's epoch since
    the lookup says so, and the read is the pinned one."""
    mgr, _, keys = hooked(tmp_path / "s", knobs)
    with mgr:
        directory, lookup = mgr.manager.directory, mgr.manager.directory.slots_and_rows

        def looked_up(*args, **kw):
            found = lookup(*args, **kw)
            directory.slots_and_rows = lookup
            evict_2_and_3(mgr, keys)
            return found
        directory.slots_and_rows = looked_up
        read_2_3_4_pinned_again(mgr, keys)
        assert directory.slots_and_rows is lookup                      # the lookup was made once


def test_row_guesses_are_checked_against_the_keys_and_a_wrong_one_is_looked_up(tmp_path, knobs):
    """``read(..., rows=)``: each key's directory row as an earlier read found it spares the lookup; a
    guess that names another key's row (shuffled, stale after a row was reused), no row or one past the
    directory is looked up, and the read lends exactly the blocks asked for."""
    with manager(tmp_path / "s", knobs, gpu=16) as mgr:
        keys = stored(mgr, 9)
        out = torch.zeros(4, BLOCK, dtype=torch.uint8)
        rows = mgr.rows(keys)
        assert (rows >= 0).all() and len(set(rows.tolist())) == 9 and mgr.rows([key(99)]).tolist() == [-1]

        def lent(asked: list[int], guesses: list[int]) -> None:
            future = mgr.read([keys[i] for i in asked], into=out, lend=True, pin=False,
                              rows=torch.tensor(guesses).numpy())
            assert isinstance(future.lease, Lent) and future.rows.tolist() == rows[asked].tolist()
            extent, at = future.extent
            assert all(torch.equal(extent[row], block(i)) for i, row in zip(asked, at.tolist()))
            assert future.lease.release()

        lent([1, 2, 3, 4], rows[[1, 2, 3, 4]].tolist())                 # right
        lent([1, 2, 3, 4], rows[[4, 3, 2, 1]].tolist())                 # other keys' rows
        lent([1, 2, 3, 4], [-1, 10**9, int(rows[2]), -5])                # none, past the directory, mixed
        mgr.drop([keys[0]])
        newcomer = key(50)
        mgr.put(newcomer, block(50))
        assert mgr.rows([newcomer]).tolist() == [rows[0]]                 # keys[0]'s row, reused
        lent([1, 5, 6, 7], [int(rows[0]), *rows[[5, 6, 7]].tolist()])  # a stale guess: the newcomer's row
        assert_quiescent(mgr.manager)


def space_manager(path, knobs, gpu=4, cpu=4) -> BlockingTierManager:
    """The gpu and cpu tiers as ranges of one HostSpace (what build_tiers makes without CUDA), a store below."""
    space = HostSpace(BLOCK)
    tiers = [GpuTier(BLOCK, gpu * BLOCK, torch.device("cpu"), space=space), CpuTier(BLOCK, cpu * BLOCK, space=space),
             NvmeTier(path, BLOCK, 256 * BLOCK)]
    return BlockingTierManager(TierManager(tiers, knobs=knobs))


@pytest.mark.parametrize("pin", [False, True])
def test_a_lent_packed_read_in_one_host_space_copies_nothing_the_loaded_blocks_included(tmp_path, knobs, pin):
    """Blocks in the gpu and the cpu tier and on disk: the ones in memory are lent where they lie, as rows
    of the space; ``wait`` fills in the rows of the loaded ones, pinned until ``release``."""
    with space_manager(tmp_path / "s", knobs, gpu=8) as mgr:
        keys = stored(mgr, 16)
        on = {name: [i for i, k in enumerate(keys) if mgr.where(k)[0] == name] for name in ("gpu", "cpu", "nvme")}
        asked = [*on["gpu"][:2], *on["cpu"][:2], *on["nvme"][:2]]   # the loads evict blocks not lent
        out = torch.zeros(len(asked), BLOCK, dtype=torch.uint8)
        future = mgr.read([keys[i] for i in asked], into=out, lend=True, pin=pin, packed=True)
        space, at = future.extent
        assert space.data_ptr() == mgr.space.rows().data_ptr() and future.missing == [4, 5]
        assert (at[future.missing] == -1).all() and (at[future.ready] >= 0).all()
        assert all(torch.equal(space[at[i]], block(asked[i])) for i in future.ready) and not out.any()
        assert isinstance(future.lease, Lease if pin else Watched) and future.lease.release()
        future.wait()
        assert (at >= 0).all() and all(torch.equal(space[at[i]], block(asked[i])) for i in range(len(asked)))
        assert not out.any() and sum(t.pool.busy_slots() for t in mgr.manager.tiers.values())   # the loaded: pinned
        future.release()
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)


def test_a_watched_lend_fails_when_one_of_its_own_slots_was_freed_not_another(tmp_path, knobs):
    """Unlike a ``Lent`` (any slot of the tier freed), a ``Watched`` lease fails only when a slot it
    lent was freed: a load running beside the read evicts other blocks without failing it. A future
    cancelled after ``wait`` lets go of what it lent."""
    with space_manager(tmp_path / "s", knobs, gpu=8) as mgr:
        keys = stored(mgr, 20)
        out = torch.zeros(4, BLOCK, dtype=torch.uint8)
        on_gpu, on_cpu = ([k for k in keys if mgr.where(k)[0] == name] for name in ("gpu", "cpu"))
        on_disk = [k for k in keys if mgr.where(k) == ["nvme"]]
        future = mgr.read([on_gpu[0], on_cpu[0], *on_disk[:2]], into=out, lend=True, pin=False, packed=True)
        assert isinstance(future.lease, Watched) and future.missing
        hits = len(mgr.manager.events.of_kind("hit"))
        mgr.drop([on_gpu[5]])                               # another block's slot
        assert future.lease.release()
        assert [e.src for e in mgr.manager.events.of_kind("hit")[hits:]] == ["gpu", "cpu"]   # once it passed
        future.wait()
        future.cancel()                                     # lets go of the loaded blocks
        mgr.contains(keys[0])
        assert_quiescent(mgr.manager)
        on_gpu, on_cpu = ([k for k in keys if mgr.where(k)[:1] == [name]] for name in ("gpu", "cpu"))
        asked = [on_gpu[0], on_cpu[0], *(k for k in on_disk if mgr.where(k) == ["nvme"])][:4]
        future = mgr.read(asked, into=out, lend=True, pin=False, packed=True)
        assert isinstance(future.lease, Watched) and future.missing == [2, 3]
        hits = len(mgr.manager.events.of_kind("hit"))
        mgr.drop([on_cpu[0]])                               # one of the lent blocks' own slots
        assert not future.lease.release() and len(mgr.manager.events.of_kind("hit")) == hits
        future.cancel()
        settle(mgr, keys[0])
        assert_quiescent(mgr.manager)


def test_a_read_into_fewer_rows_than_keys_is_refused(tmp_path, knobs):
    """Refused whether the blocks are in memory or load: a loading block used to land in another's
    row where the destination had too few."""
    with manager(tmp_path, knobs, gpu=2, cpu=2) as mgr:
        keys = stored(mgr, 12)
        mgr.read(keys[:1], into=torch.empty(1, BLOCK, dtype=torch.uint8)).wait()    # 0 in memory, 1 on disk
        around = torch.zeros(3, BLOCK, dtype=torch.uint8)
        for read in (keys[:2], keys[:1] + keys[8:9]):
            with pytest.raises(ValueError, match=r"read of 2 block\(s\) into 1 row\(s\)"):
                mgr.read(read, into=around[:1])
        assert not around.any()
        mgr.contains(keys[0])                                                     # the unpins have run
        assert_quiescent(mgr.manager)


def test_a_closed_manager_says_so(tmp_path, knobs):
    mgr = manager(tmp_path, knobs)
    keys = stored(mgr, 2)
    mgr.close()
    for use in (lambda: mgr.put(key(5), block(5)), lambda: mgr.read(keys, into=torch.empty(2, BLOCK, dtype=torch.uint8)),
                lambda: mgr.contains(keys[0])):
        with pytest.raises(ManagerClosed, match="the tier manager is closed"):
            use()


def test_an_acquire_interrupted_while_it_waits_leaves_no_pin(tmp_path, knobs):
    """Ctrl-C or SIGTERM while the loop still works on an acquire: its lease used to stay pinned, and the
    drop that a batch's cleanup makes next failed with "still pinned"."""
    import signal

    class Interrupt(BaseException):
        pass

    def interrupt(signum, frame):
        raise Interrupt

    with manager(tmp_path, knobs) as mgr:
        keys = stored(mgr, 2)
        mgr._loop.call_soon_threadsafe(time.sleep, 0.3)      # the loop busy: the acquire below waits for it
        before = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            with pytest.raises(Interrupt):
                mgr.acquire(keys)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        mgr.drop(keys)
        assert_quiescent(mgr.manager)
