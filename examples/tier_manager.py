"""The tier manager on its own: put blocks, the ones memory cannot hold land on disk, read them back.

    .venv/bin/python examples/tier_manager.py

Blocks are fixed-size byte buffers named by content keys. The gpu tier (host
memory under a budget when there is no CUDA) holds 8 blocks, the cpu tier
32; a put goes to the fastest tier with room, so the rest are stored in an
NVMe store in a temporary directory.
"""
import asyncio
import tempfile

import torch

from tierkv.config import TierConfig
from tierkv.keys import BlockKey
from tierkv.manager import TierManager

BLOCK = 256 * 1024


async def main(spill: str) -> None:
    config = TierConfig(block_bytes=BLOCK, gpu=8 * BLOCK, cpu=32 * BLOCK, nvme_dir=spill)
    async with TierManager.from_config(config) as manager:
        keys = [BlockKey.of("example", i) for i in range(100)]
        for i, key in enumerate(keys):
            await manager.put(key, torch.full((BLOCK,), i % 251, dtype=torch.uint8))
        print("where block 0 lives:", manager.where(keys[0]), "| block 99:", manager.where(keys[99]))
        manager.prefetch(keys[:4], "gpu")                    # background, lower priority
        lease = await manager.acquire(keys[:4], "gpu")        # pinned until released
        print("block 3 reads back as", int(lease.views[3][0]))
        lease.release()
        moved = {e.kind.value for e in manager.events.events}
        print("transfers recorded:", sorted(moved))
        for name in manager.order:
            print(f"{name:5s} used {manager.used_bytes(name) / 2**20:6.1f} MiB of "
                  f"{manager.tiers[name].budget_bytes / 2**20:8.1f} MiB")


with tempfile.TemporaryDirectory() as spill:
    asyncio.run(main(spill))
