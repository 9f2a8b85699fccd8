import asyncio
import time

import numpy as np
import pytest
import torch

from tierkv.config import TierConfig
from tierkv.keys import BlockKey
from tierkv.errors import BlockCorrupt
from tierkv.manager import BlockingTierManager, TierManager
from tierkv.manager.lease import Watched
from tierkv.model.sparse_engine import SparseEngine
from tierkv.layout import BlockLayout
from tierkv.sparse import SparseConfig, SparseSequence
from tierkv.sparse import sequence as sequence_module, step as step_module
from tierkv.sparse.order import Placed, ascending, merge_slots, page_slots, token_rows
from tierkv.sparse.reads import PageReader
from tierkv.sparse.step import gather_context
from tierkv.tiers.memory import MemoryTier

H, D = 2, 16


def config(**kw) -> SparseConfig:
    return SparseConfig(**{"budget": 4096, "sink_tokens": 8, "window_tokens": 16, "page_tokens": 16} | kw)


def sequence(manager, cfg, rank=H * D, **kw) -> SparseSequence:
    layout = BlockLayout.page(cfg.page_tokens, H, D, rank, torch.float32)
    return SparseSequence(manager, cfg, layout, num_layers=1, dtype=torch.float32,
                          needs=frozenset({"landmarks"}), **kw)


def pages_manager(cfg, rank=H * D, **budgets) -> BlockingTierManager:
    layout = BlockLayout.page(cfg.page_tokens, H, D, rank, torch.float32)
    return BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes,
                                                      **({"gpu": "1MiB", "cpu": "1MiB"} | budgets)))


def test_page_round_trip_is_4k_aligned():
    layout = BlockLayout.page(32, 3, 64, 96, torch.bfloat16)
    assert layout.payload_bytes == 32 * (192 + 96) * 2 and layout.block_bytes % 4096 == 0
    v, a = torch.randn(32, 3, 64), torch.randn(32, 96)
    values, factors = layout.unpack(torch.stack([layout.pack(v, a)] * 2))
    assert torch.equal(values[1], v.bfloat16()) and torch.equal(factors[0], a.bfloat16())


def test_regions_and_sealing():
    cfg = config()
    with pages_manager(cfg) as manager:
        seq = sequence(manager, cfg)
        k, v = torch.randn(100, H, D), torch.randn(100, H, D)
        seq.append(0, k[:60], v[:60])
        assert seq.sealed(0) == 8 and len(seq.layers[0].pages) == 0    # no basis yet: all exact
        seq.fit(0, H * D)
        assert len(seq.layers[0].pages) == 2 and seq.sealed(0) == 40   # 52 in window -> 2 pages sealed
        seq.append(0, k[60:], v[60:])
        assert seq.sealed(0) == 72 and seq.window(0)[0].shape[0] == 28
        assert torch.equal(seq.sinks(0)[0], k[:8]) and torch.equal(seq.window(0)[1], v[72:])
        assert seq.index(0).chunks == 8


def indexed_tokens(manager, cfg, tokens=200):
    """Random tokens sealed at full rank: (sequence, k, v, outlier chunk ids, candidate chunk ids)."""
    seq = sequence(manager, cfg)
    k, v = torch.randn(tokens, H, D), torch.randn(tokens, H, D)
    seq.append(0, k, v)
    seq.fit(0, H * D)
    return seq, k, v, sorted(seq.index(0).outliers), seq.index(0).candidates.nonzero().flatten()


def assert_exact(got, k, v, expect_per_head):
    got_k, got_v, pos = got
    for h, expect in enumerate(expect_per_head):
        assert pos[h].tolist() == expect
        assert torch.allclose(got_k[h], k[expect, h], atol=1e-5)
        assert torch.equal(got_v[h], v[expect, h])


def tokens_of(chunks):
    return sorted(8 + c * 8 + j for c in chunks for j in range(8))


def test_full_rank_gather_returns_the_exact_keys_values_and_positions():
    cfg = config(outlier_fraction=0.2)
    with pages_manager(cfg) as manager:
        seq, k, v, outliers, free = indexed_tokens(manager, cfg)
        chunks = torch.stack([free[[0, 3, 9]], free[[2, 3, 17]]])
        assert outliers and not set(outliers) & set(chunks.flatten().tolist())
        assert_exact(seq.gather(0, chunks), k, v, [tokens_of([*chunks[h].tolist(), *outliers]) for h in range(H)])


def test_pages_in_one_host_tier_or_two_sharing_a_space_are_read_in_place(monkeypatch):
    """A read whose pages all lie in one host tier takes their rows where they lie (nothing copied out
    whole); so does one whose pages lie in the gpu and the cpu tier, both host memory here and ranges
    of one ``HostSpace``. Both give the exact keys and values, and leave nothing pinned."""
    cfg = config(outlier_fraction=0.2)
    block = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.float32).block_bytes
    copies: list[int] = []
    real = BlockingTierManager.copy_out
    monkeypatch.setattr(BlockingTierManager, "copy_out", lambda self, lease, out, rows=None: (
        copies.append(len(lease.places)), real(self, lease, out, rows))[1])
    with pages_manager(cfg, gpu=8 * block) as manager:
        seq, k, v, outliers, free = indexed_tokens(manager, cfg)
        per_page = cfg.page_tokens // cfg.chunk_tokens
        tier_of = {int(c): manager.where(seq.layers[0].pages[int(c) // per_page])[0] for c in free}
        on_gpu = [c for c, tier in tier_of.items() if tier == "gpu"]
        on_cpu = [c for c, tier in tier_of.items() if tier == "cpu"]
        assert on_gpu and on_cpu                                  # the gpu tier holds 8 of 11 pages
        assert manager.space is not None
        for chunks in (torch.tensor([[on_gpu[0]], [on_gpu[-1]]]),        # one tier
                       torch.tensor([[on_gpu[0]], [on_cpu[0]]])):        # two, one space
            copies.clear()
            assert_exact(seq.gather(0, chunks), k, v, [tokens_of([*chunks[h].tolist(), *outliers]) for h in range(H)])
            assert copies == [] and manager.busy_blocks() == 0


def test_a_split_read_lends_pages_unpinned_and_reads_them_again_pinned_if_a_slot_was_freed(monkeypatch):
    """A split gather (overlap) finds pages all in place without a hop to the manager's loop and pins
    nothing. When the tier gives a slot back while the rows are taken (here: another block dropped),
    it cannot trust them and reads the pages again, pinned: the keys and values are exact either way."""
    cfg = config(outlier_fraction=0.2)
    with pages_manager(cfg) as manager:
        seq, k, v, outliers, free = indexed_tokens(manager, cfg)
        other = BlockKey.of("another", seq.layout.block_bytes, 0)
        manager.put(other, torch.zeros(seq.layout.block_bytes, dtype=torch.uint8))
        chunks = torch.stack([free[[0, 3, 9]], free[[2, 3, 17]]])
        expect = [tokens_of([*chunks[h].tolist(), *outliers]) for h in range(H)]
        reads: list[bool] = []
        real_read, real_rebuild = BlockingTierManager.read, PageReader._rebuild
        monkeypatch.setattr(BlockingTierManager, "read", lambda self, *a, **kw: (
            reads.append(kw.get("pin", True)), real_read(self, *a, **kw))[1])
        got = seq.gather_split(0, chunks)
        assert got[3] is None and reads == [False] and manager.busy_blocks() == 0
        assert_exact(got[:3], k, v, expect)

        def rebuild_while_a_slot_is_freed(self, *a, **kw):
            if manager.contains(other):
                manager.drop([other])
            return real_rebuild(self, *a, **kw)
        monkeypatch.setattr(PageReader, "_rebuild", rebuild_while_a_slot_is_freed)
        reads.clear()
        got = seq.gather_split(0, chunks)
        assert reads == [False, True] and got[3] is None and manager.busy_blocks() == 0
        assert_exact(got[:3], k, v, expect)


def test_whole_pages_give_every_head_every_indexed_chunk_of_the_pages_read():
    """Two chunks per 16-token page: the heads' chunks widen to their pages' chunks, the same for
    every head, outliers still once; the same pages are read, the keys and values stay exact."""
    cfg = config(outlier_fraction=0.2)
    with pages_manager(cfg) as manager:
        seq, k, v, outliers, free = indexed_tokens(manager, cfg)
        chunks = torch.stack([free[[0, 3]], free[[3, 9]]])
        seq.gather(0, chunks)
        read = seq.stats.pages
        pages = {c // 2 for c in chunks.flatten().tolist()}
        widened = [c for p in sorted(pages) for c in (2 * p, 2 * p + 1) if c not in outliers]
        assert seq.page_chunks(0, chunks).tolist() == widened and len(widened) > chunks.shape[1]
        got = seq.gather(0, torch.tensor(widened).expand(H, -1), shared=True)
        assert seq.stats.pages == 2 * read                          # no page more than before
        assert_exact(got, k, v, [tokens_of([*widened, *outliers])] * H)


def test_full_rank_rebuilt_keys_rotated_equal_the_real_post_rope_keys(tiny_loaded):
    from tierkv.model.arch import rope_cos_sin
    from tierkv.ops.rope import apply_rope
    cfg = SparseConfig(budget=4096, sink_tokens=8, window_tokens=16, page_tokens=16, rank=32,
                       positions="original")
    layout = SparseEngine.page_layout(tiny_loaded, cfg)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="4MiB")) as manager:
        engine = SparseEngine(tiny_loaded, manager, cfg)
        seq = engine.new_sequence(300)
        k_pre, v = torch.randn(300, 2, 16), torch.randn(300, 2, 16)
        seq.append(0, k_pre, v)
        seq.fit(0, 32)
        k_mid, _, pos = seq.gather(0, torch.arange(0, 30).expand(2, -1))
        rebuilt = engine.rope.rotate_heads(k_mid, pos)                            # [Hkv, T, D]
        cos, sin = rope_cos_sin(tiny_loaded.model, torch.arange(300))
        real = apply_rope(k_pre.transpose(0, 1).unsqueeze(0), cos, sin)[0]    # [Hkv, 300, D]
        assert torch.allclose(rebuilt, real[:, pos[0]], atol=1e-4)


def test_cross_step_reuse_is_counted():
    cfg = config()
    with pages_manager(cfg) as manager:
        seq = sequence(manager, cfg)
        seq.append(0, torch.randn(300, H, D), torch.randn(300, H, D))
        seq.fit(0, H * D)
        seq.gather(0, torch.tensor([[0, 1], [4, 5]]))      # pages 0, 2
        seq.gather(0, torch.tensor([[0, 7], [4, 5]]))      # pages 0, 2, 3
        assert (seq.stats.pages, seq.stats.reused) == (5, 2)


def test_a_corrupt_page_is_an_error_and_leaves_nothing_pinned(tmp_path):
    cfg = config()
    layout = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.float32)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu=layout.block_bytes * 2, cpu=0, nvme_dir=tmp_path)
    with BlockingTierManager.from_config(tiers) as manager:
        seq = sequence(manager, cfg, persist=True)
        seq.append(0, torch.randn(200, H, D), torch.randn(200, H, D))
        seq.fit(0, H * D)
        manager.flush()
        victim = seq.layers[0].pages[5]
        assert manager.where(victim) == ["nvme"]
        slot = manager.manager.store.lookup(victim)
        with open(tmp_path / "slots.dat", "r+b") as f:     # flip a byte of the page on disk
            f.seek(slot * layout.block_bytes + 100)
            byte = f.read(1)
            f.seek(slot * layout.block_bytes + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(BlockCorrupt):
            seq.gather(0, torch.tensor([[10, 11], [0, 10]]))  # page 5 holds chunks 10-11
        for tier in manager.manager.tiers.values():
            assert all(tier.pool.pins(s) == 0 for s in tier.pool.slots_in_use())


def pinned(manager: TierManager) -> list[tuple[str, int]]:
    return [(name, slot) for name, tier in manager.tiers.items() for slot in tier.pool.slots_in_use()
            if tier.pool.pins(slot)]


async def test_cancelled_page_fetch_leaks_nothing(tmp_path):
    cfg = config()
    layout = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.float32)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu=layout.block_bytes * 64, cpu=0, nvme_dir=tmp_path)
    async with TierManager.from_config(tiers) as manager:
        keys = []
        for p in range(48):
            key = BlockKey.of("page", p)
            await manager.put(key, layout.pack(torch.randn(16, H, D), torch.randn(16, H * D)),
                              tier="nvme")
            keys.append(key)
        await manager.flush()
        task = asyncio.create_task(manager.acquire(keys, "gpu"))
        await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # quiescent once the moves the cancelled read started are over: their completions run as loop
        # callbacks after the executor is idle (checking at once raced them: a rare failure)
        deadline = asyncio.get_running_loop().time() + 10
        while pinned(manager) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        assert not manager._executor.busy and pinned(manager) == []
        lease = await manager.acquire(keys[:4], "gpu")     # and the pages still read back
        lease.release()


def test_a_split_gather_returns_what_is_in_place_and_brings_the_rest(tmp_path):
    cfg = config()
    layout = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.float32)
    with pages_manager(cfg, gpu=8 * layout.block_bytes, cpu=0, nvme_dir=tmp_path / "s") as manager:
        seq, k, v, outliers, candidates = indexed_tokens(manager, cfg)   # 11 pages: the first ones on NVMe
        chunks = torch.stack([candidates[:2], candidates[-2:]])          # the heads read different pages
        expect = [tokens_of([*chunks[h].tolist(), *outliers]) for h in range(H)]
        k_got, v_got, pos, loading = seq.gather_split(0, chunks)
        assert loading is not None and loading.missing.any() and not loading.missing.all()
        ready = ~loading.missing
        for h in range(H):
            assert pos[h].tolist() == expect[h]
            rows = torch.tensor(expect[h])[ready[h]]
            assert torch.allclose(k_got[h, ready[h]], k[rows, h], atol=1e-5)
            assert torch.equal(v_got[h, ready[h]], v[rows, h])
            assert not k_got[h, loading.missing[h]].any()                 # zeros until they arrive
        at, valid, k_new, v_new = loading.finish()
        for h in range(H):
            assert sorted(at[h, valid[h]].tolist()) == loading.missing[h].nonzero().flatten().tolist()
            rows = torch.tensor(expect[h])[at[h, valid[h]]]
            assert torch.allclose(k_new[h, valid[h]], k[rows, h], atol=1e-5)
            assert torch.equal(v_new[h, valid[h]], v[rows, h])
        with pytest.raises(RuntimeError, match="already"):
            loading.finish()
        assert manager.busy_blocks() == 0
        assert seq.gather_split(0, chunks)[3] is None                     # every page is in place now


class Interrupted(Exception):
    pass


def whole_split_gather(seq, chunks):
    """``gather_split``, then its late rows written in: (k, v, pos), and whether any were late."""
    k, v, pos, loading = seq.gather_split(0, chunks)
    if loading is None:
        return (k, v, pos), False
    at, valid, k_new, v_new = loading.finish()
    k, v = k.clone(), v.clone()
    for h in range(k.shape[0]):
        k[h, at[h, valid[h]]], v[h, at[h, valid[h]]] = k_new[h, valid[h]], v_new[h, valid[h]]
    return (k, v, pos), True


def test_a_split_gather_that_fails_after_its_read_lets_go_of_the_pages_still_loading(tmp_path, monkeypatch):
    """An error between the read and the ``Loading`` that would bring its late pages (writing the
    outliers' rows; joining the sinks and the window) leaves nothing pinned once the loads land: a
    leaked pin would keep a page in its slot for good, and enough of them would leave a long-running
    server no room."""
    cfg = config(outlier_fraction=0.2)
    block = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.float32).block_bytes
    with pages_manager(cfg, gpu=8 * block, cpu=8 * block, nvme_dir=tmp_path / "s") as manager:
        seq, _, _, outliers, candidates = indexed_tokens(manager, cfg, 408)
        assert len(outliers)

        def broken(*args, **kwargs):
            raise Interrupted()

        def let_go() -> bool:
            """Whether a moment comes, within 10 s, with no slot pinned or reserved (the manager's own moves
            come and go; a leaked pin stays)."""
            deadline = time.monotonic() + 10
            while manager.busy_blocks():                # (each count is a hop: released pins go first)
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
            return True
        for module, name, gather in ((sequence_module, "put_rows", seq.gather_split),
                                     (step_module, "joinable", lambda layer, chunks: gather_context(
                                         seq, layer, chunks, split=True))):
            on_disk = [c for c in candidates.tolist() if manager.where(seq.layers[0].pages[c // 2]) == ["nvme"]]
            chunks = torch.tensor(on_disk[:2 * H]).view(H, 2).sort(dim=1).values
            with monkeypatch.context() as patch:
                patch.setattr(module, name, broken)
                with pytest.raises(Interrupted):
                    gather(0, chunks)
            assert let_go(), name


def test_a_split_gather_in_one_host_space_copies_no_page_the_loaded_ones_included(tmp_path, monkeypatch):
    """The gpu and the cpu tier are ranges of one ``HostSpace``: a split gather takes the rows of the
    pages in memory where they lie, and of those it loads from disk where they land, copying no page
    whole. When its lent pages may have moved while their rows were taken (the check fails), it reads
    them again, pinned. Exact either way, nothing left pinned."""
    cfg = config(outlier_fraction=0.2)
    block = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.float32).block_bytes
    with pages_manager(cfg, gpu=8 * block, cpu=2 * block, nvme_dir=tmp_path / "s") as manager:
        seq, k, v, outliers, candidates = indexed_tokens(manager, cfg, 408)   # 24 pages: 14 on disk alone
        assert manager.space is not None

        def spread() -> torch.Tensor:
            """Per head, a chunk of a page on disk alone or in the cpu tier, and one in the gpu tier: four
            pages, no more than half the gpu tier (read in one group)."""
            tier = {c: manager.where(seq.layers[0].pages[c // 2])[0] for c in candidates.tolist()}
            first = {name: [c for c, t in tier.items() if t == name] for name in ("gpu", "cpu", "nvme")}
            assert all(first.values())
            return torch.tensor([sorted([first["nvme"][0], first["gpu"][0]]),
                                 sorted([first["cpu"][0], first["gpu"][-1]])])
        copies, reads = [], []
        monkeypatch.setattr(MemoryTier, "gather", lambda self, *a, **kw: copies.append(self.name))
        real_read = BlockingTierManager.read
        monkeypatch.setattr(BlockingTierManager, "read", lambda self, *a, **kw: (
            reads.append(kw.get("pin", True)), real_read(self, *a, **kw))[1])
        chunks = spread()
        expect = [tokens_of([*chunks[h].tolist(), *outliers]) for h in range(H)]
        got, late = whole_split_gather(seq, chunks)
        assert late and copies == [] and reads == [False] and manager.busy_blocks() == 0
        assert_exact(got, k, v, expect)

        checks = iter([False])
        real_release = Watched.release
        monkeypatch.setattr(Watched, "release", lambda self: next(checks, None) is not False and real_release(self))
        chunks = spread()
        expect = [tokens_of([*chunks[h].tolist(), *outliers]) for h in range(H)]
        reads.clear()
        got, _ = whole_split_gather(seq, chunks)     # (the pinned read may find the first one's loads landed)
        assert reads == [False, True] and copies == [] and manager.busy_blocks() == 0
        assert_exact(got, k, v, expect)


def test_a_crop_before_the_basis_is_fitted_takes_its_keys_out_of_the_gram_matrix():
    cfg = config()
    keys, values = torch.randn(60, H, D, dtype=torch.float64).float(), torch.randn(60, H, D)
    with pages_manager(cfg) as manager:
        cropped, shorter = sequence(manager, cfg), sequence(manager, cfg)
        cropped.append(0, keys, values)
        cropped.crop(5)
        shorter.append(0, keys[:55], values[:55])
        assert cropped.length(0) == 55
        torch.testing.assert_close(cropped.layers[0].basis.gram, shorter.layers[0].basis.gram)
        torch.testing.assert_close(cropped.window(0)[0], shorter.window(0)[0])


def test_late_pages_with_no_sinks_or_window_land_in_the_joined_keys(tmp_path):
    """bf16 pages under a float32 model, and nothing to attend while they load (no sinks, no window): the
    rows that arrive late are written into K and V as joined with the float32 outliers, each row what it
    would be from a plain read (pages rounded to bf16, outliers exact)."""
    cfg = config(sink_tokens=0, window_tokens=0, outlier_fraction=0.1)
    layout = BlockLayout.page(cfg.page_tokens, H, D, H * D, torch.bfloat16)
    tiers = TierConfig(block_bytes=layout.block_bytes, gpu=8 * layout.block_bytes, cpu=0, nvme_dir=tmp_path / "s")
    with BlockingTierManager.from_config(tiers) as manager:
        seq = SparseSequence(manager, cfg, layout, num_layers=1, dtype=torch.float32, needs=frozenset({"landmarks"}))
        k, v = torch.randn(192, H, D), torch.randn(192, H, D)
        seq.append(0, k, v)
        seq.fit(0, H * D)                                   # 12 pages, the first ones on NVMe; no window left
        outliers, candidates = sorted(seq.index(0).outliers), seq.index(0).candidates.nonzero().flatten()
        assert outliers and seq.window(0)[0].shape[0] == 0
        context = gather_context(seq, 0, torch.stack([candidates[:2], candidates[-2:]]), split=True)
        assert context.loading is None and context.k.dtype == torch.float32
        exact = {8 * c + j for c in outliers for j in range(8)}
        for h in range(H):
            for row, p in enumerate(context.p[h].tolist()):
                want_k, want_v = (k[p, h], v[p, h]) if p in exact else (k[p, h].bfloat16().float(),
                                                                         v[p, h].bfloat16().float())
                assert torch.equal(context.k[h, row], want_k) and torch.equal(context.v[h, row], want_v)


def test_merged_slots_put_the_chunks_and_the_outliers_in_the_order_sorting_would():
    rng = np.random.default_rng(7)
    for trial in range(200):
        heads, k, m = int(rng.integers(1, 4)), int(rng.integers(0, 60)), int(rng.integers(0, 12))
        outliers = np.sort(rng.permutation(300)[:m])
        candidates = np.setdiff1d(np.arange(300), outliers)
        chunks = ascending(np.stack([rng.permutation(candidates)[:k] for _ in range(heads)]))
        at, at_out = merge_slots(chunks, outliers)
        merged = np.empty((heads, k + m), dtype=np.int64)
        merged[np.arange(heads)[:, None], at], merged[np.arange(heads)[:, None], at_out] = chunks, outliers
        assert (merged == np.sort(np.concatenate([chunks, np.broadcast_to(outliers, (heads, m))], 1), axis=1)).all()
        rows = token_rows(at, 4)
        assert rows.shape == (heads, 4 * k) and (rows[:, ::4] // 4 == at).all()
    assert token_rows(np.array([[0, 2]]), 3).tolist() == [[0, 1, 2, 6, 7, 8]]


def test_page_slots_are_what_unique_gives():
    rng = np.random.default_rng(3)
    for _ in range(50):
        pages = rng.integers(0, 40, size=(3, int(rng.integers(0, 30))))
        got, at = page_slots(pages)
        want, inverse = np.unique(pages, return_inverse=True)
        assert got.tolist() == want.tolist() and at.tolist() == inverse.reshape(pages.shape).tolist()


def test_table_rows_are_the_sources_as_rows_of_the_pages_table():
    """`Placed.table_rows`, worked out a chunk at a time, names the row that `sources` names a token at
    a time: page j's token t of head h at ``pages[j] * per_block + t * per_token + h``, margins and
    outlier slots at the first page's first token."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        heads, c, P = int(rng.integers(1, 4)), int(rng.choice([2, 4, 8])), 16
        k, m = int(rng.integers(1, 12)), int(rng.integers(0, 4))
        chunks = ascending(np.stack([rng.permutation(64)[:k] for _ in range(heads)]))
        outliers = np.sort(rng.permutation(np.setdiff1d(np.arange(64, 80), chunks))[:m])
        at, _ = merge_slots(chunks, outliers)
        pages, page = page_slots(chunks // (P // c))
        before, after = int(rng.integers(0, 5)), int(rng.integers(0, 5))
        M = (k + m) * c
        place = Placed(chunks, page, at, (before, M), before + M + after, c, P)
        ids = rng.permutation(200)[:len(pages)]                   # where each page lies in the buffer
        per_block, per_token = int(rng.integers(P * heads, 4 * P * heads)), heads
        page_of, tok_of = place.sources()
        want = ids[page_of] * per_block + tok_of * per_token + np.arange(heads)[:, None]
        assert (place.table_rows(ids, per_block, per_token) == want).all()


@pytest.mark.parametrize("page_dtype,rank", [("int8", H * D), (None, H * D // 2)])
def test_decoded_or_rebuilt_keys_fill_the_context_buffer_around_the_exact_outliers(page_dtype, rank):
    """Keys decoded from quantized pages, or rebuilt through a low-rank basis (one product for every
    head when they share their chunks), are float32 rows of their own: they land in the rows the
    gather leaves between the caller's margins, in token order with the outliers, which stay exact."""
    cfg = config(outlier_fraction=0.2, page_dtype=page_dtype)
    layout = BlockLayout.page(cfg.page_tokens, H, D, rank, torch.float32, codec=cfg.codec)
    with BlockingTierManager.from_config(TierConfig(block_bytes=layout.block_bytes, gpu="1MiB", cpu="1MiB")) as manager:
        seq = SparseSequence(manager, cfg, layout, num_layers=1, dtype=torch.float32, needs=frozenset({"landmarks"}))
        k, v = torch.randn(200, H, D), torch.randn(200, H, D)
        seq.append(0, k, v)
        seq.fit(0, rank)
        outliers = sorted(seq.index(0).outliers)
        free = seq.index(0).candidates.nonzero().flatten()
        assert outliers
        for chunks, shared in ((torch.stack([free[[0, 3, 9]], free[[2, 3, 17]]]), False),
                               (free[[1, 4, 8]].expand(H, -1), True)):
            got_k, got_v, pos = seq.gather(0, chunks, shared=shared, margins=(5, 7))
            plain_k, plain_v, plain_pos = seq.gather(0, chunks, shared=shared)
            assert got_k.shape == (H, 5 + pos.shape[1] + 7, D) and torch.equal(pos, plain_pos)
            assert torch.equal(got_k[:, 5:-7], plain_k) and torch.equal(got_v[:, 5:-7], plain_v)
            for h in range(H):
                assert pos[h].tolist() == tokens_of([*chunks[h].tolist(), *outliers])
                exact = [i for i, p in enumerate(pos[h].tolist()) if (p - 8) // 8 in outliers]
                rows = torch.tensor(exact) + 5
                assert torch.equal(got_k[h, rows], k[pos[h, exact], h])
                assert torch.equal(got_v[h, rows], v[pos[h, exact], h])
                near = torch.tensor([i for i in range(pos.shape[1]) if i not in exact])
                assert torch.allclose(got_v[h, near + 5], v[pos[h, near], h], atol=0.1)
                if page_dtype is None:             # the basis is fitted to these keys: half rank loses some
                    assert (got_k[h, near + 5] - k[pos[h, near], h]).norm() < k[pos[h, near], h].norm()
                else:
                    assert torch.allclose(got_k[h, near + 5], k[pos[h, near], h], atol=0.1)
