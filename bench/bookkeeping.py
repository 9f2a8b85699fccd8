"""How many bytes does tierkv keep in memory for each block of a reopened store?

Writes a store of ``--blocks`` blocks (default 982,530: the pages of a 1M-token
sparse prefill) on disk, closes it, and reopens it through a `TierManager`
(a cpu tier over the store), as a stored document is reopened, and reads a
few blocks into the cpu tier. Then it counts the arrays that name, place and
order every block, and times the lookup a sparse layer's read makes (526
keys) and the count of held blocks ``tierkv serve``'s /health makes::

    directory  key table: key 16 B, live flag, hash cells     \\
               rows: holders, layer, index, generation,        > the manager's bookkeeping
               slot per tier, the store's LRU stamp            /  (target: 64 B a block)
    pools      slot states and pins (memory tiers: generations)/
    journal    the store's own index: key table and checksum by slot

Blocks are 4 KiB (the bookkeeping does not depend on their size); the write is
O_DIRECT in batches, ~4 GiB at the default count.

    python bench/bookkeeping.py --out bench/out/bookkeeping.json
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np
import psutil
import torch

from report import Help, Report, machine, out_file, stop_on_sigterm
from tierkv.keys import BlockKey
from tierkv.knobs import IOKnobs
from tierkv.manager import BlockingTierManager, TierManager
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.nvme import NvmeTier

BLOCK = 4096
BATCH = 4096                 # blocks written a call
LOOKUP_KEYS = 526            # pages one layer of a 32K sparse step reads
TARGET = 64.0                # bytes a block: the directory and the pools


def write_store(path: Path, n: int) -> float:
    """A store of ``n`` blocks (each its index in its first bytes) closed on disk; seconds taken."""
    start = time.perf_counter()
    store = NvmeTier(path, BLOCK, n * BLOCK, namespace="bench-bookkeeping")
    rows = torch.zeros(BATCH, BLOCK, dtype=torch.uint8)
    try:
        for lo in range(0, n, BATCH):
            count = min(BATCH, n - lo)
            keys = BlockKey.series("bench-bookkeeping", first=lo, count=count)
            rows[:count, :8].view(torch.int64)[:, 0] = torch.arange(lo, lo + count)
            slots = store.pool.reserve_many(count)
            store.write([(key, slot, rows[i]) for i, (key, slot) in enumerate(zip(keys, slots))])
            store.pool.commit_many(slots)
    finally:
        store.close()
    return time.perf_counter() - start


def measure(path: Path, n: int, report: Report) -> None:
    rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    store = NvmeTier(path, BLOCK, n * BLOCK, namespace="bench-bookkeeping")
    blocking = BlockingTierManager(TierManager([CpuTier(BLOCK, 1024 * BLOCK), store], knobs=IOKnobs()))
    seconds = time.perf_counter() - start
    manager = blocking.manager   # read here while its loop idles
    try:
        grown = psutil.Process().memory_info().rss - rss
        keys = BlockKey.series("bench-bookkeeping", first=0, count=n)
        blocking.acquire(keys[:LOOKUP_KEYS], tier="cpu").release()   # a read: the cpu tier's column exists
        directory, pools = manager.directory, [tier.pool for tier in manager.tiers.values()]
        if len(directory) != n:
            raise RuntimeError(f"the reopened store holds {len(directory)} blocks, {n} were written")
        parts = {
            **{f"directory: {part}": nbytes for part, nbytes in directory.nbytes_parts().items()},
            "pools: states and pins (memory tiers: generations)": sum(pool.nbytes() for pool in pools),
            "journal index (the store's)": store.index_nbytes(),
        }
        for part, nbytes in parts.items():
            report.add_row(part, "bytes a block", round(nbytes / n, 2), "B")
        manager_bytes = directory.nbytes() + parts["pools: states and pins (memory tiers: generations)"]
        report.add_row("manager: directory + pools", "bytes a block", round(manager_bytes / n, 2), "B")
        report.add_row("all, with the journal index", "bytes a block",
                       round((manager_bytes + parts["journal index (the store's)"]) / n, 2), "B")
        report.add_row("reopen", "seconds", round(seconds, 2), "s")
        report.add_row("reopen", "RSS grown a block", round(grown / n, 1), "B")
        rng = np.random.default_rng(0)
        batches = [[keys[i] for i in np.sort(rng.choice(n, LOOKUP_KEYS, replace=False)).tolist()] for _ in range(64)]
        lookup = min(timeit.repeat(lambda: [directory.find_rows(b) for b in batches], number=1, repeat=5))
        report.add_row(f"lookup of {LOOKUP_KEYS} keys", "time", round(lookup / len(batches) * 1e6, 1), "us")
        held = min(timeit.repeat(directory.held_count, number=1, repeat=5))      # what /health counts
        report.add_row("held blocks counted (serve's /health)", "time", round(held * 1e3, 3), "ms")
        report.add_ratio("manager_bytes_per_block", round(manager_bytes / n, 2), TARGET,
                         f"the directory's arrays and the tiers' pools over {n:,} blocks of a reopened store, "
                         "bytes a block", ceiling=True)
        report.add_bound(f"the directory's key table: {directory.table_fill:.0%} of its hash cells in use (a table is "
                         "rebuilt 30 % full and grows past half); the journal index keeps its own key table "
                         "for the same blocks (the store opens without a manager)")
    finally:
        blocking.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=Help)
    p.add_argument("--blocks", type=int, default=982_530, help="blocks in the store (default: a 1M-token prefill's)")
    p.add_argument("--quick", action="store_true", help="100,000 blocks")
    p.add_argument("--dir", type=Path, default=None, help="where to write the store (default: a temporary dir)")
    p.add_argument("--out", type=out_file, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks = 100_000
    if args.blocks < LOOKUP_KEYS:
        p.error(f"--blocks {args.blocks}: at least {LOOKUP_KEYS} (one lookup's keys)")
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    stop_on_sigterm()
    start = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="tierkv-bookkeeping-", dir=args.dir))
    report = Report("bookkeeping", args.quick, machine(base))
    try:
        written = write_store(base / "store", args.blocks)
        report.add_bound(f"store: {args.blocks:,} blocks of {BLOCK} B written in {written:.1f} s, then reopened")
        measure(base / "store", args.blocks, report)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return report.finish(start, args.out)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
