"""A simulated CXL memory pool as a tier, and chunk selection done at the memory.

    .venv/bin/python examples/cxl_pool.py

Part 1: the cpu tier holds 8 blocks, a CXL 2.0 x8 pool behind it 64; blocks
the cpu tier has no room for go to the pool, and reading them back costs what the link
model charges (here a link slowed to 1 GB/s so the time is visible).
Part 2: the ``near-memory`` selector picks the same chunks as ``shadowkv``
while only the query and the chosen ids cross the link.
"""
import asyncio
from types import SimpleNamespace

import torch

from policies.selectors import make_selector
from tierkv.config import TierConfig
from tierkv.keys import BlockKey
from tierkv.manager import TierManager
from tierkv.profile.summary import summarize
from tierkv.profile.summary_text import format_summary
from tierkv.tiers.cxl_link import Direction

BLOCK = 256 * 1024


async def pool_tier() -> None:
    config = TierConfig(block_bytes=BLOCK, gpu=0, cpu=8 * BLOCK, cxl=64 * BLOCK,
                        cxl_preset="cxl2-x8", cxl_read_gbps=1.0, cxl_write_gbps=1.0)
    async with TierManager.from_config(config) as manager:
        keys = [BlockKey.of("example", i) for i in range(40)]
        for i, key in enumerate(keys):
            await manager.put(key, torch.full((BLOCK,), i, dtype=torch.uint8))
        print("tiers:", manager.order, "| block 0 is in", manager.where(keys[0]),
              "| block 20 in", manager.where(keys[20]))
        lease = await manager.acquire(keys[20:26])        # loaded from the pool into cpu
        print("block 23 reads back as", int(lease.views[3][0]))
        lease.release()
        link = manager.tiers["cxl"].link.stats
        print(f"pool link: {link.nbytes[Direction.WRITE] / 2**20:.1f} MiB written, "
              f"{link.nbytes[Direction.READ] / 2**20:.1f} MiB read, {link.link_s * 1e3:.1f} ms on the link, "
              f"{link.queue_s * 1e3:.1f} ms queued")
        print(format_summary(summarize(manager.events.events, phase="all")).split("\n\n", 1)[-1])


def near_memory_selection() -> None:
    g = torch.Generator().manual_seed(0)
    view = SimpleNamespace(layer=0, landmarks=torch.randn(16384, 3, 64, generator=g), landmark_scale=None,
                           landmark_norm=None, lo=None, hi=None, candidates=torch.ones(16384, dtype=torch.bool))
    query = torch.randn(9, 64, generator=g)
    host, near = make_selector("shadowkv"), make_selector("near-memory")
    same = torch.equal(host.select(query, view, 328), near.select(query, view, 328))
    stats = near.stats
    print(f"\nnear-memory selection: same chunks as shadowkv: {same}; landmarks mirrored once "
          f"({stats['mirrored_bytes'] / 2**20:.1f} MiB), then per selection {query.nbytes} B of query in "
          f"and {stats['link_read_bytes']} B of ids back; modelled processor time "
          f"{stats['compute_s'] * 1e6:.0f} us")


asyncio.run(pool_tier())
near_memory_selection()
