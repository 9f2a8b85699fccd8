"""ArrayLRU (the store's LRU order in the directory's arrays) chooses what LRUPolicy chooses."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from policies.lru import LRUPolicy
from tierkv.config import TierConfig
from tierkv.keys import BlockKey
from tierkv.manager import array_lru
from tierkv.manager.array_lru import ArrayLRU
from tierkv.manager.directory import Directory
from tierkv.manager.manager import TierManager
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.nvme import NvmeTier


@pytest.mark.parametrize("limit", [None, 100])
@pytest.mark.parametrize("seed", range(8))
def test_same_victims_as_lru_on_random_histories(seed: int, limit: int | None, monkeypatch) -> None:
    """``limit``: the clocks pass it every ~100 stamps, so the stamps are renumbered again and again."""
    if limit is not None:
        monkeypatch.setattr(array_lru, "STAMP_LIMIT", limit)
    rng = random.Random(seed)
    universe = [BlockKey.of("array-lru", i) for i in range(60)]
    directory = Directory()
    for key in universe:
        directory.add(key, hold=False).copies["nvme"] = 0
    array, plain = ArrayLRU(directory, "nvme"), LRUPolicy()
    known: set[BlockKey] = set()
    for _ in range(3000):
        roll, key = rng.random(), rng.choice(universe)
        if roll < 0.3:
            array.insert(key), plain.insert(key)
            known.add(key)
        elif roll < 0.38:
            array.insert_cold(key), plain.insert_cold(key)
            known.add(key)
        elif roll < 0.55:
            array.touch(key), plain.touch(key)
        elif roll < 0.65:
            keys = rng.sample(universe, rng.randint(1, 8)) * rng.randint(1, 2)
            array.touch_many(keys), plain.touch_many(keys)
        elif roll < 0.75:
            array.remove(key), plain.remove(key)
            known.discard(key)
        else:
            protected = frozenset(rng.sample(universe, rng.randint(0, 40)))
            n = rng.randint(0, 6)
            chosen = array.evict(n, protected)
            assert chosen == plain.evict(n, protected)
            known.difference_update(chosen or ())
        assert len(array) == len(plain) == len(known)
    if limit is not None:
        assert array._clock <= limit and array._cold <= limit


def test_a_forgotten_row_leaves_the_order_and_a_million_stamps_cost_4_bytes_each() -> None:
    directory = Directory()
    a, b = BlockKey.of("a"), BlockKey.of("b")
    directory.add(a, hold=False).copies["nvme"] = 1
    lru = ArrayLRU(directory, "nvme")
    lru.insert(a)
    directory.get(a).copies.pop("nvme")
    directory.forget_if_empty(a)
    directory.add(b, hold=False).copies["nvme"] = 2     # reuses a's row, which must not look ordered
    assert len(lru) == 0 and lru.evict(1, frozenset()) is None
    with pytest.raises(KeyError):
        lru.insert(a)
    n = 1_000_000
    digests = np.random.default_rng(3).integers(0, 1 << 63, (n, 2), dtype=np.uint64).tobytes()
    keys = [BlockKey(digests[i * 16:(i + 1) * 16]) for i in range(n)]
    directory.add_copies(keys, "nvme", range(n))
    before = directory.nbytes()
    for key in keys[:1000]:
        lru.insert(key)
    assert (directory.nbytes() - before) / n <= 8 and len(lru) == 1000   # the column, grown by doubling
    assert lru.evict(2, frozenset(keys[:1])) == keys[1:3]


def test_a_store_gets_the_array_lru_by_default_and_keeps_a_policy_it_is_given(tmp_path) -> None:
    made: list[TierManager] = []

    def manager(**kw: object) -> TierManager:
        tiers = [CpuTier(4096, 4 * 4096), NvmeTier(tmp_path / str(len(made)), 4096, 16 * 4096, namespace="t")]
        made.append(TierManager(tiers, **kw))
        return made[-1]

    def from_config(config: TierConfig) -> TierManager:
        made.append(TierManager.from_config(config))
        return made[-1]

    try:
        assert isinstance(manager().policies["nvme"], ArrayLRU)
        assert isinstance(manager().policies["cpu"], LRUPolicy)
        given = LRUPolicy()
        assert manager(policies={"nvme": given}).policies["nvme"] is given
        config = TierConfig(block_bytes=4096, cpu=4 * 4096, nvme_dir=tmp_path / "c", nvme_budget=16 * 4096)
        assert isinstance(from_config(config).policies["nvme"], ArrayLRU)
        assert type(from_config(replace(config, nvme_dir=tmp_path / "d", nvme_policy="fifo")).policies["nvme"]) \
            .__name__ == "FIFOPolicy"
    finally:
        for m in made:
            m.store.close()
