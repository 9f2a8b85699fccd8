"""A process that holds an NVMe store open for the shared-store tests.

Run with no arguments, it answers commands from stdin, one JSON object a line
(``{"op": "open", ...}``), with one JSON line each on stdout. Run with
``spill DIR BLOCK_BYTES SLOTS TAG``, it opens the store and writes forever,
dropping its oldest block when it has no free slot, printing the number of
batches written after each: a writer to kill.

A block's bytes derive from its key alone, so any process can check them.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

from tierkv.keys import BlockKey
from tierkv.tiers.nvme import NvmeTier


def key(tag: str, i: int) -> BlockKey:
    return BlockKey.of(tag, i)


def expected(k: BlockKey, block_bytes: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(k.digest[:8], "little")).integers(0, 256, block_bytes, np.uint8)


def write_blocks(tier: NvmeTier, keys: list[BlockKey], slots: list[int]) -> None:
    """Write the blocks of ``keys`` into their reserved ``slots`` and commit them."""
    tier.write([(k, slot, torch.from_numpy(expected(k, tier.block_bytes))) for k, slot in zip(keys, slots)])
    for slot in slots:
        tier.pool.commit(slot)


def read_blocks(tier: NvmeTier, placed: list[tuple[BlockKey, int]]) -> tuple[int, int, int]:
    """(served, failed, wrong) reading ``placed``: wrong is a block served with bytes it was not given."""
    items = [(k, slot, torch.empty(tier.block_bytes, dtype=torch.uint8)) for k, slot in placed]
    failed = set(tier.read(items))
    served = [(k, dst) for k, _, dst in items if k not in failed]
    wrong = sum(1 for k, dst in served if not np.array_equal(dst.numpy(), expected(k, tier.block_bytes)))
    return len(served), len(failed), wrong


class Worker:
    def __init__(self) -> None:
        self.tier: NvmeTier | None = None
        self.live: collections.deque[tuple[BlockKey, int]] = collections.deque()   # oldest first

    def open(self, path: str, block_bytes: int, slots: int) -> dict:
        self.tier = NvmeTier(path, block_bytes, slots * block_bytes, io_threads=2)
        self.live = collections.deque(sorted(self.tier.items(), key=lambda item: item[1]))
        return {"visible": len(self.live)}

    def close(self) -> dict:
        self.tier.close()
        self.tier = None
        return {}

    def flush(self) -> dict:
        self.tier.flush()
        return {}

    def write(self, tag: str, first: int, count: int, batch: int = 4, churn: bool = False) -> dict:
        """Write blocks ``first .. first+count-1`` of ``tag`` in batches; ``churn``: when no slot is
        free, drop this worker's oldest block and reuse its slot."""
        placed = {}
        for lo in range(first, first + count, batch):
            keys = [key(tag, i) for i in range(lo, min(lo + batch, first + count))]
            slots = [self._reserve(churn) for _ in keys]
            write_blocks(self.tier, keys, slots)
            self.live.extend(zip(keys, slots))
            placed |= {k.hex(): slot for k, slot in zip(keys, slots)}
        return {"placed": placed}

    def refresh(self) -> dict:
        """Take in other processes' blocks and let go of those gone, looking twice (what a manager does)."""
        added = removed = 0
        for _ in range(2):
            changes = self.tier.refresh()
            gone = {k for k, _ in changes.removed}
            self.live = collections.deque((k, s) for k, s in self.live if k not in gone)
            for _, slot in changes.removed:
                self.tier.pool.release(slot)
            self.live.extend(changes.added)
            added, removed = added + len(changes.added), removed + len(changes.removed)
        return {"added": added, "removed": removed}

    def verify(self) -> dict:
        """Refresh, then read every visible block."""
        self.refresh()
        served, failed, wrong = read_blocks(self.tier, self.tier.items())
        return {"visible": len(self.tier), "served": served, "failed": failed, "wrong": wrong,
                "keys": sorted(k.hex() for k, _ in self.tier.items())}

    def read_loop(self, seconds: float, refresh_every: int = 8) -> dict:
        """Read every visible block over and over for ``seconds``, refreshing now and then."""
        totals, rounds, end = [0, 0, 0], 0, time.monotonic() + seconds
        while time.monotonic() < end:
            if rounds % refresh_every == 0:
                self.refresh()
            for n, got in enumerate(read_blocks(self.tier, self.tier.items())):
                totals[n] += got
            rounds += 1
        return {"served": totals[0], "failed": totals[1], "wrong": totals[2], "rounds": rounds}

    def fork_child(self, seconds: float) -> dict:
        """Fork a child that does not exec (a multiprocessing or DataLoader worker) and lives ``seconds``;
        its pid, and what it got trying the store it inherited."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                self.tier.write([])
                use = "no error"
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                use = f"{type(exc).__name__}: {exc}"
            os.write(write_end, use.encode())
            os.close(write_end)
            time.sleep(seconds)
            os._exit(0)
        os.close(write_end)
        use = os.read(read_end, 4096).decode()
        os.close(read_end)
        return {"pid": pid, "use": use}

    def _reserve(self, churn: bool) -> int:
        pool = self.tier.pool
        while churn and not pool.can_reserve():
            old_key, old_slot = self.live.popleft()
            if self.tier.lookup(old_key) == old_slot:
                self.tier.drop(old_key)
                pool.release(old_slot)
        return pool.reserve()


def serve() -> None:
    worker = Worker()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply = getattr(worker, command.pop("op"))(**command)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


def spill(path: str, block_bytes: int, slots: int, tag: str) -> None:
    worker = Worker()
    worker.open(path, block_bytes, slots)
    for batch in range(1, 1 << 60):
        worker.write(tag, 4 * batch, 4, churn=True)
        print(batch, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["spill"]:
        spill(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        serve()
