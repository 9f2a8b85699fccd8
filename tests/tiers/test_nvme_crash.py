"""NvmeTier under crashes and damage: SIGKILL mid-spill, torn and corrupt journals, a full disk."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv.errors import DiskFullError
from tierkv.keys import BlockKey
from tierkv.tiers.journal import RECORD_BYTES, Op, Record
from tierkv.tiers.nvme import NvmeTier

BB = 16 * 1024
SLOTS = 48


def key(i: int) -> BlockKey:
    return BlockKey.of("crash-block", i)


def expected(k: BlockKey) -> torch.Tensor:
    rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, BB, dtype=np.uint8))


def put(tier: NvmeTier, ids: list[int]) -> dict[BlockKey, int]:
    items = [(key(i), tier.pool.reserve(), expected(key(i))) for i in ids]
    tier.write(items)
    for _, slot, _ in items:
        tier.pool.commit(slot)
    return {k: s for k, s, _ in items}


def verify_all(tier: NvmeTier) -> tuple[int, int]:
    """(visible blocks, wrong blocks): a wrong block reads back 'ok' with bytes it was not given."""
    items = [(k, s, torch.empty(BB, dtype=torch.uint8)) for k, s in tier.items()]
    failed = set(tier.read(items))
    wrong = sum(1 for k, _, dst in items if k not in failed and not torch.equal(dst, expected(k)))
    return len(items) - len(failed), wrong


# The writer spills forever: batches of 4 blocks whose bytes derive from their key; when the
# store is full it drops and releases the oldest block first, so slots are reused all the time.
WRITER = textwrap.dedent(f"""
    import collections, sys, numpy as np, torch
    from tierkv.keys import BlockKey
    from tierkv.tiers.nvme import NvmeTier

    def data(k):
        rng = np.random.default_rng(int.from_bytes(k.digest[:8], "little"))
        return torch.from_numpy(rng.integers(0, 256, {BB}, dtype=np.uint8))

    tier = NvmeTier(sys.argv[1], {BB}, {SLOTS * BB}, io_threads=2)
    live = collections.deque(sorted(tier.items(), key=lambda item: item[1]))
    i = int(sys.argv[2])
    while True:
        batch = []
        for _ in range(4):
            if not tier.pool.can_reserve():
                old_key, old_slot = live.popleft()
                tier.drop(old_key)
                tier.pool.release(old_slot)
            k = BlockKey.of("crash-block", i)
            batch.append((k, tier.pool.reserve(), data(k)))
            i += 1
        tier.write(batch)
        for k, slot, _ in batch:
            tier.pool.commit(slot)
            live.append((k, slot))
        print(i, flush=True)
""")


def spill_and_kill(store: Path, first: int, batches: int) -> int:
    """Run the writer until it reports ``batches`` batches, SIGKILL it; the next unused id."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(first)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for _ in range(batches):
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else "writer died"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return int(line)


def test_sigkill_mid_spill_leaves_only_verified_blocks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = 0
    for batches in (30, 45):  # the second run reopens a store a killed writer left behind
        reported = spill_and_kill(store, first, batches)
        with NvmeTier(store, BB, SLOTS * BB) as tier:
            visible, wrong = verify_all(tier)
            assert wrong == 0
            assert visible == len(tier.items()) >= SLOTS - 4  # at most the batch in flight is missing
            for i in range(reported - 4, reported):  # the last reported batch survived the kill
                assert tier.lookup(key(i)) is not None, i
        first = reported + 1000


@pytest.mark.parametrize("tail", [b"\x00garbage-after-the-last-record", "half"])
def test_torn_journal_tail_is_cut_on_open(tmp_path: Path, tail: bytes | str) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as tier:
        placed = put(tier, [0, 1, 2])
    journal = store / "index.log"
    if tail == "half":
        tail = Record(Op.PUT, key(9), 5, 1234).encode()[:RECORD_BYTES // 2]
    with open(journal, "ab") as f:
        f.write(tail)
    with NvmeTier(store, BB, 8 * BB) as tier:
        assert journal.stat().st_size == 3 * RECORD_BYTES
        assert dict(tier.items()) == placed
        assert verify_all(tier) == (3, 0)
        put(tier, [3])  # appends continue the valid prefix
    with NvmeTier(store, BB, 8 * BB) as tier:
        assert verify_all(tier) == (4, 0)


def _corrupt_record(journal: Path, index: int) -> None:
    with open(journal, "r+b") as f:
        f.seek(index * RECORD_BYTES + RECORD_BYTES - 2)  # inside the CRC
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_put_in_the_middle_is_ignored(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 8 * BB) as tier:
        placed = {}
        for i in range(5):
            placed |= put(tier, [i])  # one record per batch
    _corrupt_record(store / "index.log", 2)
    with NvmeTier(store, BB, 8 * BB) as tier:
        assert tier.lookup(key(2)) is None
        assert dict(tier.items()) == {k: s for k, s in placed.items() if k != key(2)}
        assert verify_all(tier) == (4, 0)
        assert (store / "index.log").stat().st_size == 4 * RECORD_BYTES  # compacted away
        assert tier.pool.free == 8 - 4


def test_corrupt_drop_cannot_resurrect_a_block_whose_slot_was_reused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with NvmeTier(store, BB, 2 * BB) as tier:
        slot = put(tier, [0])[key(0)]
        tier.drop(key(0))                      # record 1
        tier.pool.release(slot)
        assert put(tier, [1])[key(1)] == slot  # record 2: same slot, other bytes
    _corrupt_record(store / "index.log", 1)
    with NvmeTier(store, BB, 2 * BB) as tier:
        assert tier.items() == [(key(1), slot)]
        assert verify_all(tier) == (1, 0)


def test_lost_drop_with_rewritten_slot_fails_checksum_not_served(tmp_path: Path) -> None:
    """A DROP that never reached the journal and a PUT lost too: the stale entry must not verify."""
    store = tmp_path / "store"
    with NvmeTier(store, BB, 2 * BB) as tier:
        slot = put(tier, [0])[key(0)]
    with open(store / "slots.dat", "r+b") as f:  # the slot's bytes were overwritten by a later block
        f.seek(slot * BB)
        f.write(expected(key(1)).numpy().tobytes())
    with NvmeTier(store, BB, 2 * BB) as tier:
        assert tier.read([(key(0), slot, torch.empty(BB, dtype=torch.uint8))]) == [key(0)]


def test_full_disk_raises_disk_full_and_keeps_earlier_blocks(tiny_tmpfs: Path) -> None:
    store = tiny_tmpfs / "store"
    placed: dict[BlockKey, int] = {}
    with NvmeTier(store, BB, 1024 * BB) as tier:  # budget far above the 2 MiB the disk has
        with pytest.raises(DiskFullError) as info:
            for i in range(1024):
                placed |= put(tier, [2 * i, 2 * i + 1])
        assert str(store) in str(info.value) and "bytes" in str(info.value)
        assert 2 * 16 < len(placed) < 2 * 64  # about 2 MiB of 16 KiB blocks
        assert len(tier.items()) == len(placed)
        assert verify_all(tier) == (len(placed), 0)
        filler = os.open(tiny_tmpfs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError, match="No space"):
            while True:  # take every byte left
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        tier.drop(next(iter(placed)))  # dropping still works on a full disk
    with NvmeTier(store, BB, 1024 * BB) as tier:  # and so does reopening it
        assert verify_all(tier) == (len(placed) - 1, 0)


KILLS = int(os.environ.get("TIERKV_CRASH_KILLS", "24"))   # 120 and more: see bench/RESULTS.md
STORE_POINTS = ("nvme.after-data", "journal.mid-record", "journal.after-record")


def _spill_until_killed(root: Path, start: int, point: str, visit: int) -> None:
    """A forked child: arm ``point`` to die at its ``visit``-th pass, then spill forever."""
    from tierkv import failpoints
    failpoints.arm(f"{point}:{visit}")
    tier = NvmeTier(root, BB, SLOTS * BB, io_threads=2)
    live = sorted(tier.items(), key=lambda item: item[1])
    i = start
    while True:
        batch = []
        for _ in range(4):
            if not tier.pool.can_reserve():
                old_key, old_slot = live.pop(0)
                tier.drop(old_key)
                tier.pool.release(old_slot)
            batch.append((key(i), tier.pool.reserve(), expected(key(i))))
            i += 1
        tier.write(batch)
        for k, slot, _ in batch:
            tier.pool.commit(slot)
            live.append((k, slot))


def test_a_kill_at_every_failpoint_leaves_no_wrong_block(tmp_path):
    """Real SIGKILLs exactly between a block's bytes and its journal record, half way through a
    record, and after it: every reopen serves each visible block's own bytes, or fails it."""
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    rng, root, kills, visible = np.random.default_rng(1), tmp_path / "store", 0, []
    for n in range(KILLS):
        point = STORE_POINTS[n % len(STORE_POINTS)]
        child = fork.Process(target=_spill_until_killed, args=(root, 1000 * n, point, int(rng.integers(1, 30))))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == -signal.SIGKILL, f"{point}: exit {child.exitcode}"
        kills += 1
        tier = NvmeTier(root, BB, SLOTS * BB, io_threads=2)
        seen, wrong = verify_all(tier)
        tier.close()
        assert wrong == 0
        visible.append(seen)
    assert kills == KILLS and max(visible) > 0
