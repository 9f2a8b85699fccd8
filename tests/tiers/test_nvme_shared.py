"""One NVMe store, several openers: in this process (flock counts each open as a process), through the
manager, and in real processes: each reads what the others wrote, writers never meet in a slot, a
reader never gets another block's bytes while a writer drops and rewrites, a killed writer's slots
come back."""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import nvme_worker
import pytest
import torch
from nvme_worker import key

from tierkv.errors import BudgetExceeded, StoreUnusable
from tierkv.keys import BlockKey
from policies.lru import LRUPolicy
from tierkv.manager import TierManager
from tierkv.manager.directory import Directory
from tierkv.manager.residency import Residency
from tierkv.tiers import journal, nvme, nvme_share
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.journal import RECORD_BYTES, Op
from tierkv.tiers.nvme import NvmeTier

WORKER = Path(nvme_worker.__file__)
BB = 16 * 1024
TIMEOUT_S = 60


class Proc:
    """A worker process (tests/tiers/nvme_worker.py) driven one JSON command at a time."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen([sys.executable, str(WORKER), *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def send(self, op: str, **kw: object) -> None:
        self.popen.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.popen.stdin.flush()

    def line(self) -> str:
        """The next line it prints; a worker that hangs is killed after TIMEOUT_S."""
        watchdog = threading.Timer(TIMEOUT_S, self.popen.kill)
        watchdog.start()
        try:
            line = self.popen.stdout.readline()
        finally:
            watchdog.cancel()
        assert line, f"worker exited with {self.popen.poll()}"
        return line

    def reply(self) -> dict:
        reply = json.loads(self.line())
        assert "error" not in reply, reply["error"]
        return reply

    def call(self, op: str, **kw: object) -> dict:
        self.send(op, **kw)
        return self.reply()

    def stop(self) -> None:
        self.popen.kill()
        self.popen.wait(timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def workers():
    """Two worker processes for the module: starting one (importing torch) takes seconds."""
    procs = [Proc(), Proc()]
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture
def pair(workers, tmp_path: Path):
    """Both workers with ``tmp_path / "store"`` open (64 slots); closed again after the test."""
    store = tmp_path / "store"
    for proc in workers:
        proc.call("open", path=str(store), block_bytes=BB, slots=64)
    yield store, workers
    for proc in workers:
        proc.call("close")


def expected(k: BlockKey) -> np.ndarray:
    return nvme_worker.expected(k, BB)


def put(tier: NvmeTier, tag: str, ids: range) -> dict[BlockKey, int]:
    """Reserve, write and commit blocks ``ids`` of ``tag`` in this process; key -> slot."""
    keys = [key(tag, i) for i in ids]
    slots = [tier.pool.reserve() for _ in keys]
    nvme_worker.write_blocks(tier, keys, slots)
    return dict(zip(keys, slots))


def verify(tier: NvmeTier) -> tuple[int, int]:
    """(visible, wrong) in this process."""
    served, _, wrong = nvme_worker.read_blocks(tier, tier.items())
    return served, wrong


def journal_history(store: Path) -> tuple[dict[int, set[str]], int]:
    """Which tags' PUTs each slot saw, and how many records failed their checks, over the whole journal."""
    raw = (store / "index.log").read_bytes()
    assert len(raw) % RECORD_BYTES == 0
    good, whole = journal.check(raw)
    tags = {key(tag, i).digest: tag for tag in "AB" for i in range(4096)}
    writers: dict[int, set[str]] = defaultdict(set)
    for op, digest, slot, _ in journal.rows(raw, good):
        if op == Op.PUT:
            writers[slot].add(tags.get(digest, "?"))
    return writers, whole - len(good)


# -- two openers in this process (flock is per open file description: each counts as a process) --------
def test_refresh_reports_blocks_added_and_gone_and_a_rewritten_slot_waits_for_its_release(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as a, NvmeTier(store, BB, 8 * BB) as b:
        slot = put(a, "A", range(1))[key("A", 0)]
        assert b.refresh().added == [(key("A", 0), slot)]
        a.drop(key("A", 0))
        a.pool.release(slot)
        assert put(a, "A", range(1, 2)) == {key("A", 1): slot}   # the same slot, other bytes
        changes = b.refresh()
        assert (changes.added, changes.removed) == ([], [(key("A", 0), slot)])
        assert b.read([(key("A", 0), slot, torch.empty(BB, dtype=torch.uint8))]) == [key("A", 0)]
        b.pool.release(slot)   # what the manager does with a block gone
        assert b.refresh().added == [(key("A", 1), slot)]
        assert verify(b) == (1, 0)


def test_a_key_moved_to_another_slot_comes_in_after_its_old_copy_goes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as a, NvmeTier(store, BB, 8 * BB) as b, NvmeTier(store, BB, 8 * BB) as c:
        old = put(a, "A", range(1))[key("A", 0)]
        b.refresh()
        a.drop(key("A", 0))
        new = put(c, "A", range(1))[key("A", 0)]   # the same block, written again by another process
        changes = b.refresh()
        assert (changes.added, changes.removed) == ([], [(key("A", 0), old)])
        b.pool.release(old)
        assert b.refresh().added == [(key("A", 0), new)]
        assert verify(b) == (1, 0)


def test_dropping_another_live_process_block_forgets_it_here_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as a, NvmeTier(store, BB, 8 * BB) as b:
        slot = put(a, "A", range(1))[key("A", 0)]
        b.refresh()
        size = (store / "index.log").stat().st_size
        b.drop(key("A", 0))
        b.pool.release(slot)
        assert b.lookup(key("A", 0)) is None and a.lookup(key("A", 0)) == slot
        assert (store / "index.log").stat().st_size == size   # nothing journaled
        assert not b.pool.can_reserve(8)   # and the slot did not become b's
    with NvmeTier(store, BB, 8 * BB) as later:
        assert verify(later) == (1, 0)


def readable(store: Path, k: BlockKey, slots: int = 8) -> bool:
    """Whether a later opener of ``store`` (alone with it) finds ``k`` with its bytes."""
    with NvmeTier(store, BB, slots * BB) as later:
        slot = later.lookup(k)
        return slot is not None and nvme_worker.read_blocks(later, [(k, slot)]) == (1, 0, 0)


def test_a_block_two_processes_wrote_keeps_one_copy_when_the_other_is_dropped(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as a:
        mine = put(a, "A", range(1))[key("A", 0)]
        with NvmeTier(store, BB, 8 * BB) as b:
            theirs = put(b, "A", range(1))[key("A", 0)]    # the same block, computed by both
            b.drop(key("A", 0), theirs)
            b.pool.release(theirs)
        assert a.refresh().removed == [] and a.lookup(key("A", 0)) == mine
    assert readable(store, key("A", 0))


def test_a_second_copy_in_an_extent_taken_over_is_not_written_over_when_the_first_is_mine(tmp_path: Path) -> None:
    """b shows its own copy; a's copy (ignored by b's view) may be written over once a left, and b's
    copy stays live for later openers: a later PUT of the same key no longer hides an older copy."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as b:
        mine = put(b, "A", range(1))[key("A", 0)]
        a = NvmeTier(store, BB, 8 * BB)
        put(a, "A", range(1))
        b.refresh()
        a.close()
        assert put(b, "B", range(7)) and b.lookup(key("A", 0)) == mine
        assert verify(b) == (8, 0)
    assert readable(store, key("A", 0))


def test_a_copy_kept_for_a_block_shown_in_another_process_slot_comes_in_when_that_one_goes(tmp_path: Path) -> None:
    """c shows a's copy; b's copy of the same block is kept in mind (its extent taken over by c
    too), and comes in when a drops its copy."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 9 * BB) as a, NvmeTier(store, BB, 9 * BB) as c:
        shown = put(a, "A", range(1))[key("A", 0)]
        assert c.refresh().added == [(key("A", 0), shown)]
        b = NvmeTier(store, BB, 9 * BB)
        other = put(b, "A", range(1))[key("A", 0)]
        assert not c.refresh()        # a second copy: nothing changes here
        b.close()
        while c.pool.can_reserve():   # c takes every extent it may, b's too: the copy there is kept
            put(c, "C", range(len(c), len(c) + 1))
        assert c.pool.owns(other) and c.pool.state(other).value == "free"
        a.drop(key("A", 0))
        a.pool.release(shown)
        assert c.refresh().removed == [(key("A", 0), shown)]
        c.pool.release(shown)                                # the manager forgets the copy gone
        assert c.refresh().added == [(key("A", 0), other)]   # the kept copy, now c's own
        assert verify(c) == (len(c), 0)
    assert readable(store, key("A", 0), 9)


def test_a_block_dropped_here_only_comes_in_when_its_owner_leaves(tmp_path: Path) -> None:
    """b drops a block of a live process (forgotten here only, nothing journaled); once a closed and b
    takes the extent, the block is b's own, not a free slot to write over."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as b:
        a = NvmeTier(store, BB, 8 * BB)
        slot = put(a, "A", range(1))[key("A", 0)]
        b.refresh()
        b.drop(key("A", 0))
        b.pool.release(slot)
        a.close()
        placed = put(b, "B", range(7))
        assert slot not in placed.values()
        assert (key("A", 0), slot) in b.refresh().added and b.lookup(key("A", 0)) == slot
        assert verify(b) == (8, 0)
    assert readable(store, key("A", 0))


def test_a_block_waiting_for_its_slot_comes_in_when_the_extent_is_taken_over(tmp_path: Path) -> None:
    """a writes a block into a slot whose old block b still holds; a leaves and b takes the extent
    before it lets the old block go: the new one is b's own then, not a free slot."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 16 * BB) as b:   # 8 extents of 2 slots
        a = NvmeTier(store, BB, 16 * BB)
        slot = put(a, "A", range(1))[key("A", 0)]
        b.refresh()
        a.drop(key("A", 0))
        a.pool.release(slot)
        assert put(a, "A", range(1, 2)) == {key("A", 1): slot}
        assert b.refresh().removed == [(key("A", 0), slot)]   # b still holds the old block's record
        a.close()
        put(b, "B", range(1))         # takes an extent: a's, the other slot of it
        b.pool.release(slot)          # the manager forgets the old block
        assert (key("A", 1), slot) in b.refresh().added
        put(b, "B", range(1, 8))
        assert b.lookup(key("A", 1)) == slot and verify(b) == (9, 0)
    assert readable(store, key("A", 1), 16)


def test_a_kept_copy_goes_once_the_copy_shown_is_this_process_own(tmp_path: Path) -> None:
    """Two processes wrote a block and left; c keeps the older copy (in an extent it took) while it shows
    the newer in a slot it does not own; once that slot's extent is c's too, the older copy is let go
    (journaled), so its slot is written again and no slot stays kept for the life of the process."""
    store = tmp_path / "store"
    idle = NvmeTier(store, BB, 16 * BB)        # another opener: nobody below is alone (8 extents of 2 slots)
    try:
        a, x = NvmeTier(store, BB, 16 * BB), NvmeTier(store, BB, 16 * BB)
        older, newer = put(a, "K", range(1))[key("K", 0)], put(x, "K", range(1))[key("K", 0)]
        a.close(), x.close()
        with NvmeTier(store, BB, 16 * BB) as c:
            assert c.lookup(key("K", 0)) == newer and older in c.pool.kept
            placed = []
            while c.pool.can_reserve():
                placed += put(c, "C", range(len(placed), len(placed) + 1)).values()
            assert c.pool.owns(newer) and c.lookup(key("K", 0)) == newer
            assert older in placed and not c.pool.kept
            assert verify(c) == (len(placed) + 1, 0)
    finally:
        idle.close()
    assert readable(store, key("K", 0), 16)


def test_a_block_taken_over_while_a_reader_holds_an_older_copy_is_not_freed(tmp_path: Path) -> None:
    """b's directory holds a's copy of K (a reader pins it) when a drops it; the copy x left in a slot b
    took comes in: it is held back until the older copy goes, not freed as a duplicate."""
    store = tmp_path / "store"
    b = NvmeTier(store, BB, 16 * BB)
    residency = Residency({"nvme": b}, {"nvme": LRUPolicy()}, Directory(), BB)
    a, x = NvmeTier(store, BB, 16 * BB), NvmeTier(store, BB, 16 * BB)
    held, kept = put(a, "K", range(1))[key("K", 0)], put(x, "K", range(1))[key("K", 0)]
    residency.refresh_store("nvme")
    assert residency.directory.get(key("K", 0)).copies == {"nvme": held}
    x.close()
    put(b, "B", range(1))               # b takes x's extent: x's copy is kept there
    residency.refresh_store("nvme")
    b.pool.pin(held)                     # a reader holds a's copy
    a.drop(key("K", 0))
    a.pool.release(held)
    residency.refresh_store("nvme")
    assert b.lookup(key("K", 0)) == kept and b.pool.state(kept).value == "ready" and kept not in b.pool._freed
    b.pool.unpin(held)
    residency.forget_copy(key("K", 0), "nvme")    # the reader's read failed: the copy gone goes here too
    residency.refresh_store("nvme")
    assert residency.directory.get(key("K", 0)).copies == {"nvme": kept}
    put(b, "C", range(4))
    assert verify(b)[1] == 0
    a.close(), b.close()
    assert readable(store, key("K", 0), 16)


def test_a_block_reported_added_then_written_again_here_is_not_passed_on(tmp_path: Path) -> None:
    """A takeover brings a's copy of K in as b's own; b writes K again before its next look: the old
    report is dropped, so the manager never takes in a slot the store no longer shows."""
    store = tmp_path / "store"
    idle, b = NvmeTier(store, BB, 8 * BB), NvmeTier(store, BB, 8 * BB)
    try:
        a = NvmeTier(store, BB, 8 * BB)
        old = put(a, "K", range(1))[key("K", 0)]
        b.refresh()
        b.drop(key("K", 0))              # evicted here only: a holds the slot
        b.pool.release(old)
        a.close()
        new = put(b, "K", range(1))[key("K", 0)]   # the reserve takes a's extent, then b writes K again
        assert new != old and b.lookup(key("K", 0)) == new
        assert b.refresh().added == [] and b.pool.state(old).value == "free"
        assert verify(b) == (1, 0)
    finally:
        b.close(), idle.close()


def live_copies(store: Path, slots: int) -> dict[bytes, set[int]]:
    """Each key's live copies as the journal says them (the index's and the older ones)."""
    state, _ = journal.replay((store / "index.log").read_bytes(), slots)
    copies: dict[bytes, set[int]] = defaultdict(set)
    keys, where, _ = state.index.records()
    for k, slot in zip(keys, where):
        copies[k.digest].add(slot)
    for digest, slot, _ in state.extra:
        copies[digest].add(slot)
    return copies


@pytest.mark.parametrize("seed", range(24))
def test_random_openers_never_free_a_live_block_or_serve_a_wrong_one(tmp_path: Path, seed: int) -> None:
    """Three openers of a 16-slot store put, drop, look and reopen at random over ten keys (so copies of
    one block meet), each holding the blocks it was told of as a manager does (a block gone that a
    reader holds is let go of only later). After every step: no slot of a block the journal says is
    live only there is free to write, no slot is both kept and free, every block shown is READY, and
    every block read is the one its key names."""
    rng, store, slots = random.Random(seed), tmp_path / "store", 16
    tiers: dict[str, NvmeTier] = {}
    held: dict[str, dict[int, BlockKey]] = {}

    def open_(name: str) -> None:
        tiers[name] = NvmeTier(store, 512, slots * 512, backend="buffered", io_threads=1)
        held[name] = {slot: k for k, slot in tiers[name].items()}

    def look(name: str) -> None:
        tier, mine = tiers[name], held[name]
        for _ in range(2):
            changes = tier.refresh()
            for k, slot in changes.removed:
                if mine.get(slot) == k and rng.random() < 0.7:    # else a reader holds it a while
                    tier.pool.release(slot)
                    del mine[slot]
            for k, slot in changes.added:
                if k in mine.values():
                    tier.forget(k, slot)
                    tier.pool.release(slot)
                else:
                    mine[slot] = k
            if not changes.removed:
                break

    for name in "abc":
        open_(name)
    try:
        for _ in range(100):
            name = rng.choice("abc")
            tier, mine, op = tiers[name], held[name], rng.random()
            if op < 0.35:
                k = key("K", rng.randrange(10))
                if k not in mine.values() and tier.pool.can_reserve():
                    slot = tier.pool.reserve()
                    tier.write([(k, slot, torch.from_numpy(nvme_worker.expected(k, 512)))])
                    tier.pool.commit(slot)
                    mine[slot] = k
            elif op < 0.55 and mine:
                slot = rng.choice(sorted(mine))
                tier.drop(mine.pop(slot), slot)
                tier.pool.release(slot)
            elif op < 0.9:
                look(name)
            else:
                tier.close()
                open_(name)
            live = live_copies(store, slots)
            only = {next(iter(where)) for where in live.values() if len(where) == 1}
            for tier in tiers.values():
                free = set(tier.pool._freed)
                assert not free & tier.pool.kept and not free & only
                assert all(tier.pool.state(slot).value == "ready" for _, slot in tier.items())
                assert nvme_worker.read_blocks(tier, tier.items())[2] == 0
                shown_here = {k.digest for k, slot in tier.items() if tier.pool.owns(slot)}
                kept_here = {digest for digest, where in live.items() for slot in where if slot in tier.pool.kept
                             and tier.pool.owns(slot) and tier.lookup(BlockKey(digest)) != slot}
                assert not kept_here & shown_here     # a copy kept beside one shown in its own slot: a leak
    finally:
        for tier in tiers.values():
            tier.close()


def test_exclusive_steps_wait_for_an_opener_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme, "COMPACT_MIN_GARBAGE", 8)
    store, log = tmp_path / "store", tmp_path / "store" / "index.log"
    with NvmeTier(store, BB, 32 * BB) as a:
        placed = put(a, "A", range(20))
        for i in range(15):
            a.drop(key("A", i))
            a.pool.release(placed[key("A", i)])
        with open(log, "ab") as f:   # half a record: a writer killed mid-append
            f.write(journal.Record(Op.PUT, key("A", 99), 7, 1).encode()[:20])
        with NvmeTier(store, BB, 32 * BB) as b:   # shared: neither cut nor compacted
            assert log.stat().st_size == 35 * RECORD_BYTES + 20
            assert verify(b) == (5, 0)
            put(a, "A", range(20, 21))   # the next append cuts the torn bytes first
            assert log.stat().st_size == 36 * RECORD_BYTES
            b.refresh()
            assert verify(b) == (6, 0)
        with NvmeTier(store, BB, 16 * BB) as smaller:   # a smaller budget beside a: hidden here, not dropped
            assert len(smaller) < 6 and log.stat().st_size == 36 * RECORD_BYTES
    with NvmeTier(store, BB, 32 * BB) as alone:
        assert log.stat().st_size == 6 * RECORD_BYTES   # compacted
        assert verify(alone) == (6, 0)


def test_extents_are_shared_equally_and_come_back_with_their_blocks_on_close(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as b:   # 8 extents of one slot
        with NvmeTier(store, BB, 8 * BB) as a:
            placed = put(a, "A", range(4))
            with pytest.raises(BudgetExceeded, match="holds 4 of 8 extents .*at most 4 while 2 processes"):
                put(a, "A", range(4, 5))   # its equal share, though extents are left
            put(b, "B", range(4))
            with pytest.raises(BudgetExceeded, match=f"pid\\(s\\) {os.getpid()}"):
                b.pool.reserve()   # nothing is taken from a live process
            b.refresh()
            assert verify(b) == (8, 0)   # b reads a's blocks
        assert not b.pool.can_reserve()   # a closed: its extents are free to claim, but full
        b.drop(key("A", 3))   # so b claims that extent to drop a block of it
        b.pool.release(placed[key("A", 3)])
        assert put(b, "B", range(4, 5)) == {key("B", 4): placed[key("A", 3)]}
        assert verify(b) == (8, 0)


def test_an_extent_taken_over_after_its_owner_closed_keeps_the_blocks_it_wrote(tmp_path: Path) -> None:
    """B had not read the journal since A wrote into an extent; A closes, and B takes the extent to
    write: A's block is not taken for a free slot, and B's next refresh brings it in."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as b:   # 8 extents of one slot
        a = NvmeTier(store, BB, 8 * BB)
        placed = put(a, "A", range(1))
        a.close()
        taken = put(b, "B", range(1))
        assert taken[key("B", 0)] != placed[key("A", 0)]
        assert (key("A", 0), placed[key("A", 0)]) in b.refresh().added
        assert verify(b) == (2, 0)
    with NvmeTier(store, BB, 8 * BB) as later:
        assert verify(later) == (2, 0)


def test_an_owner_file_removed_by_hand_stops_writes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as tier:
        slot = tier.pool.reserve()
        for owner in (store / "owners").iterdir():
            owner.unlink()
        with pytest.raises(StoreUnusable, match="owner file"):
            tier.write([(key("A", 0), slot, torch.from_numpy(expected(key("A", 0))))])


def test_a_file_system_without_flock_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_flock(fd: int, mode: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(nvme_share.fcntl, "flock", no_flock)
    with pytest.raises(StoreUnusable, match="does not support flock.*local file system"):
        NvmeTier(tmp_path / "store", BB, 8 * BB)


def test_a_directory_without_permission_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(directory: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory))

    monkeypatch.setattr(nvme_share, "make_private_dir", refused)
    with pytest.raises(StoreUnusable, match="no permission for .*store.*fix its owner or mode"):
        NvmeTier(tmp_path / "store", BB, 8 * BB)


async def test_a_manager_finds_blocks_another_process_stored_and_forgets_dropped_ones(tmp_path: Path) -> None:
    def tiers() -> list:
        return [CpuTier(BB, 4 * BB), NvmeTier(tmp_path / "store", BB, 64 * BB)]

    blocks = {key("M", i): torch.from_numpy(expected(key("M", i))) for i in range(6)}
    async with TierManager(tiers()) as first, TierManager(tiers()) as second:
        for k, data in blocks.items():
            await first.put(k, data, persist=True)
        await first.flush()
        assert second.contains(key("M", 0))   # a miss looks at the store
        lease = await second.acquire(list(blocks)[1:5], "cpu")
        assert all(torch.equal(view, blocks[k]) for k, view in zip(lease.keys, lease.views))
        lease.release()
        await first.drop([key("M", 5)])
        assert second.refresh() and not second.contains(key("M", 5))
    assert not second.contains(key("M", 5)) and not second.refresh()   # closed: no look at the store


# -- real processes -------------------------------------------------------------------------------
def test_two_processes_read_each_others_blocks(pair) -> None:
    _, (a, b) = pair
    a.send("write", tag="A", first=0, count=20)
    b.send("write", tag="B", first=0, count=20)
    placed_a, placed_b = a.reply()["placed"], b.reply()["placed"]
    assert not set(placed_a.values()) & set(placed_b.values())  # never one slot for both
    a.call("flush")
    b.call("flush")
    everything = sorted([*placed_a, *placed_b])
    for proc in (a, b):
        seen = proc.call("verify")
        assert (seen["served"], seen["failed"], seen["wrong"]) == (40, 0, 0)
        assert seen["keys"] == everything


def test_concurrent_writers_never_share_a_slot(workers, tmp_path: Path) -> None:
    store = tmp_path / "store"
    a, b = workers
    for proc in workers:
        proc.call("open", path=str(store), block_bytes=BB, slots=1024)
    a.send("write", tag="A", first=0, count=300, batch=3)
    b.send("write", tag="B", first=0, count=300, batch=5)
    a.reply(), b.reply()
    with NvmeTier(store, BB, 1024 * BB) as third:   # a third process, while both still have it open
        assert verify(third) == (600, 0)
    for proc in workers:
        proc.call("close")
    writers, damaged = journal_history(store)
    assert damaged == 0
    assert all(len(tags) == 1 for tags in writers.values()), {s: t for s, t in writers.items() if len(t) > 1}
    assert {tag for tags in writers.values() for tag in tags} == {"A", "B"}
    with NvmeTier(store, BB, 1024 * BB) as later:  # alone now: reopened, every block intact
        assert verify(later) == (600, 0)


def test_reader_never_gets_wrong_bytes_while_a_writer_drops_and_rewrites(workers, tmp_path: Path) -> None:
    store = tmp_path / "store"
    writer, reader = workers
    writer.call("open", path=str(store), block_bytes=BB, slots=64)
    reader.call("open", path=str(store), block_bytes=BB, slots=64)
    writer.call("write", tag="A", first=0, count=32)   # its equal share: 4 extents of 8 slots
    reader.send("read_loop", seconds=2.0, refresh_every=4)
    writer.send("write", tag="A", first=32, count=1200, batch=4, churn=True)  # every slot rewritten ~37 times
    reads, _ = reader.reply(), writer.reply()
    assert reads["wrong"] == 0
    assert reads["served"] >= 200, reads
    assert reads["failed"] > 0, reads   # the rewrites did race the reads
    final = reader.call("verify")
    assert (final["visible"], final["failed"], final["wrong"]) == (32, 0, 0)
    for proc in workers:
        proc.call("close")


def test_killed_writer_leaves_a_consistent_store_and_its_slots_come_back(workers, tmp_path: Path) -> None:
    store = tmp_path / "store"
    survivor = workers[0]
    survivor.call("open", path=str(store), block_bytes=BB, slots=32)
    killed = Proc("spill", str(store), str(BB), "32", "B")
    try:
        for _ in range(40):   # 160 blocks through 32 slots, then SIGKILL mid-batch
            killed.line()
        os.kill(killed.popen.pid, signal.SIGKILL)
    finally:
        killed.stop()
    seen = survivor.call("verify")
    assert seen["wrong"] == 0 and seen["served"] >= 12, seen   # its share, 16 slots, less the batch in flight
    with NvmeTier(store, BB, 32 * BB) as other:   # another opener beside the survivor
        assert verify(other) == (seen["served"], 0)
    survivor.call("write", tag="A", first=0, count=64, churn=True)   # needs the dead writer's extents
    survivor.call("flush")
    with NvmeTier(store, BB, 32 * BB) as later:
        visible, wrong = verify(later)
        assert (visible, wrong) == (32, 0)
        assert {k for k, _ in later.items()} == {key("A", i) for i in range(32, 64)}  # every slot is the survivor's
    survivor.call("close")


def test_a_child_forked_without_exec_does_not_keep_a_killed_owner_alive(tmp_path: Path) -> None:
    """A forked child (a multiprocessing worker) shares its parent's open files, flock locks included:
    the store's inherited files are let go of in the child, so when the parent is killed its extents
    come back, and the child is told to open the store itself."""
    store = tmp_path / "store"
    owner = Proc()
    child = None
    try:
        owner.call("open", path=str(store), block_bytes=BB, slots=8)
        owner.call("write", tag="A", first=0, count=2)
        owner.call("flush")
        child = owner.call("fork_child", seconds=TIMEOUT_S)
        assert child["use"].startswith("StoreUnusable") and "open it again in this process" in child["use"]
        owner.stop()                            # killed; its forked child lives on
        with NvmeTier(store, BB, 8 * BB) as tier:
            assert len(put(tier, "B", range(6))) == 6   # every slot but those of the two blocks it wrote
            assert verify(tier) == (8, 0)
    finally:
        owner.stop()
        if child is not None:
            os.kill(child["pid"], signal.SIGKILL)


async def test_a_manager_at_its_share_of_a_shared_store_makes_room_in_its_own_slots(tmp_path: Path) -> None:
    """Another process has the store open, so this one may claim half its extents: past them it evicts
    its own blocks to write back (never another's, whose slot would free nothing here), rather than
    failing, and it keeps seeing the other's blocks."""
    store = tmp_path / "store"
    other = NvmeTier(store, BB, 8 * BB)          # 8 extents of one slot: 4 each while both are open
    try:
        async with TierManager([CpuTier(BB, 1 * BB), NvmeTier(store, BB, 8 * BB)]) as m:
            theirs = put(other, "A", range(4))
            assert all(m.contains(k) for k in theirs)
            for i in range(6):
                await m.put(key("B", i), torch.from_numpy(nvme_worker.expected(key("B", i), BB)), persist=True,
                            protect=False)
                await m.flush()
            assert all(m.contains(k) for k in theirs) and all(other.lookup(k) == s for k, s in theirs.items())
            assert m.contains(key("B", 5)) and len(m.tiers["nvme"].pool._own) == 4
    finally:
        other.close()


async def test_a_manager_at_its_share_while_extents_stay_unclaimed_still_writes_back(tmp_path: Path) -> None:
    """The other opener holds no extent, so free slots remain in extents this process may not claim:
    past its share it still makes room in its own slots (it asked for a negative number of victims)."""
    store = tmp_path / "store"
    other = NvmeTier(store, BB, 8 * BB)
    try:
        async with TierManager([CpuTier(BB, 2 * BB), NvmeTier(store, BB, 8 * BB)]) as m:
            for i in range(6):
                await m.put(key("M", i), torch.from_numpy(nvme_worker.expected(key("M", i), BB)), persist=True,
                            protect=False)
                await m.flush()
            assert m.contains(key("M", 5)) and len(m.tiers["nvme"].pool._own) == 4
    finally:
        other.close()


def test_a_process_may_not_write_into_another_one_s_slots(tmp_path: Path) -> None:
    """Each opener writes only into the extents it claimed: a slot of another opener (or one named twice
    in a batch) is refused before a byte is written, and the other's block stays readable."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as a, NvmeTier(store, BB, 8 * BB) as b:
        slot = put(a, "A", range(1))[key("A", 0)]
        with pytest.raises(ValueError, match=f"slot\\(s\\) \\[{slot}\\] are not in this process's extents"):
            b.write([(key("B", 0), slot, torch.from_numpy(expected(key("B", 0))))])
        mine = b.pool.reserve()
        with pytest.raises(ValueError, match="the same slot appears twice"):
            b.write([(key("B", i), mine, torch.from_numpy(expected(key("B", i)))) for i in range(2)])
        assert verify(a) == (1, 0)


def test_a_process_whose_extents_another_unclaimed_stops_claiming(tmp_path: Path) -> None:
    """Another process reaped this one's extents (its owner file gone, say): this one may neither claim
    more nor go on writing into slots another may now take."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as tier:
        tier.pool.reserve()
        claims = tier.pool._claims
        with claims.locked():
            for extent in sorted(tier.pool._own):
                claims.write(extent, 0)                     # as a process reaping this one would
        with pytest.raises(StoreUnusable, match=r"extents \[.*\] of this process were unclaimed by another"):
            for _ in range(8):
                tier.pool.reserve()


def test_a_process_stopped_holding_the_store_s_lock_is_named_while_the_others_wait(tmp_path, monkeypatch, caplog):
    """A process stopped (Ctrl-Z) inside the store held its lock: every other opener waited for ever, saying
    nothing. It still waits (the stopped one may go on), and says for whom."""
    from tierkv.tiers import nvme_io
    from tierkv.tiers.nvme import NvmeTier
    NvmeTier(tmp_path, 4096, 16 * 4096).close()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(tmp_path / 'claims')!r}, os.O_RDWR)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        holder.send_signal(signal.SIGSTOP)
        monkeypatch.setattr(nvme_io, "LOCK_WAIT_WARN_S", 0.3)
        opened: list[NvmeTier] = []
        opener = threading.Thread(target=lambda: opened.append(NvmeTier(tmp_path, 4096, 16 * 4096)))
        with caplog.at_level("WARNING", logger="tierkv.tiers.nvme_io"):
            opener.start()
            opener.join(timeout=3)
            assert opener.is_alive() and not opened                       # waiting, as it must
            assert f"for a lock another opener holds (pid {holder.pid})" in caplog.text, caplog.text
    finally:
        holder.kill()
        holder.send_signal(signal.SIGCONT)
        holder.wait()
    opener.join(timeout=10)
    assert opened and opened[0].close() is None                               # the lock let go: it opened


def _as_another_user(*args: str) -> subprocess.CompletedProcess:
    """``tierkv args`` as root without the capabilities that pass over file modes: a user the store is not
    of (skipped where there is no setpriv, or where this is not root)."""
    if os.geteuid() != 0 or not any(Path(d, "setpriv").exists() for d in os.get_exec_path()):
        pytest.skip("needs root and setpriv to drop the file-mode capabilities")
    return subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner",
                           sys.executable, "-m", "tierkv.cli", *args], capture_output=True, text=True, timeout=120)


def test_a_store_of_another_user_is_named_so_not_a_bare_errno_nor_no_store(tmp_path):
    """Checking or using a store this user cannot read said "[Errno 13] Permission denied: '.../store.json'",
    or that there was no store in the directory."""
    from tierkv.tiers.nvme import NvmeTier
    top, inner = tmp_path / "top", tmp_path / "inner"
    for root in (top, inner):
        NvmeTier(root / "kv-L2-H1-D8-T16-B1-float32", 4096, 16 * 4096, namespace="kv-L2-H1-D8-T16-B1-float32").close()
    for other in (top, inner / "kv-L2-H1-D8-T16-B1-float32"):      # the whole directory another user's, or
        os.chown(other, 65534, 65534)                                # only the store's folder
        other.chmod(0o700)
    verify = _as_another_user("store", "verify", "--nvme-dir", str(top))
    assert verify.returncode == 2 and "cannot read it (Permission denied); a store's directory must belong" in \
        verify.stderr, verify.stderr
    run = _as_another_user("run", "--synthetic-tokens", "100", "--nvme-dir", str(top))
    assert run.returncode == 2 and "cannot look into it (Permission denied)" in run.stderr, run.stderr
    verify = _as_another_user("store", "verify", "--nvme-dir", str(inner))
    assert verify.returncode == 1 and "no permission to read store.json; the store must belong to this user" in \
        verify.stdout, verify.stdout + verify.stderr


def test_a_store_on_a_read_only_mount_is_named_so(tmp_path):
    """Opening a store on a read-only file system said only "[Errno 30] Read-only file system: '.../claims'"."""
    from tierkv.tiers.nvme import NvmeTier
    store = tmp_path / "kv"
    NvmeTier(store, 4096, 16 * 4096).close()
    if subprocess.run(["mount", "--bind", str(store), str(store)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(store)], check=True, capture_output=True)
        with pytest.raises(StoreUnusable, match=r"cannot write .*claims \(Read-only file system\); every process"):
            NvmeTier(store, 4096, 16 * 4096)
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)


def test_a_disk_full_past_another_process_s_extent_says_so(tiny_tmpfs: Path) -> None:
    """The second process on a small disk could not write its first block ("lower the NVMe budget", which
    does not help): its slots start past the first process's whole extent, which the file must span."""
    from tierkv.errors import DiskFullError
    store = tiny_tmpfs / "store"
    with NvmeTier(store, BB, 1024 * BB) as a, NvmeTier(store, BB, 1024 * BB) as b:   # extents of 128 slots, 2 MiB
        put(a, "A", range(1))
        with pytest.raises(DiskFullError, match="each take whole extents of 2.0 MiB of slots, and this one's lie "
                                                "past others'"):
            put(b, "B", range(1))
        with pytest.raises(DiskFullError) as alone:
            put(a, "A", range(1, 200))                     # its own extent: nothing of others' to say
        assert "extents" not in str(alone.value)
