"""MemoryTier: slot views, gather/scatter in runs, extents, helpers and their shutdown."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch

from tierkv.tiers import memory
from tierkv.tiers.base import Medium
from tierkv.tiers.memory import MemoryTier

BB = 1024


def make(slots: int, extent_slots: int, monkeypatch: pytest.MonkeyPatch, *, indexed: bool = False) -> MemoryTier:
    """A host tier of ``slots`` blocks in extents of ``extent_slots``; copies go by memmove in runs, or
    (``indexed``) by numpy indexing, the path of small blocks."""
    monkeypatch.setattr(memory, "EXTENT_BYTES", extent_slots * BB)
    monkeypatch.setattr(memory, "INDEXED_BYTES", BB if indexed else 0)
    return MemoryTier("cpu", Medium.CPU, torch.device("cpu"), BB, slots * BB)


def fill(tier: MemoryTier) -> None:
    for slot in range(tier.pool.capacity):
        tier.view(slot).fill_(slot % 251)


def count_memmoves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every memmove from now on, in order."""
    sizes: list[int] = []
    real = ctypes.memmove
    monkeypatch.setattr(ctypes, "memmove", lambda dst, src, n: (sizes.append(n), real(dst, src, n))[1])
    return sizes


def test_view_is_a_flat_block_of_the_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(10, 4, monkeypatch)
    view = tier.view(9)  # the last extent holds only 2 slots
    assert view.shape == (BB,) and view.dtype == torch.uint8 and view.is_contiguous()
    view.fill_(7)
    assert torch.equal(tier.view(9), torch.full((BB,), 7, dtype=torch.uint8))
    assert tier.allocated_bytes == 10 * BB
    with pytest.raises(IndexError, match="slot=10"):
        tier.view(10)


@pytest.mark.parametrize("indexed", [False, True])
def test_gather_and_scatter_keep_order_across_extents(monkeypatch: pytest.MonkeyPatch, indexed: bool) -> None:
    tier = make(10, 4, monkeypatch, indexed=indexed)
    fill(tier)
    slots = [2, 3, 4, 5, 9, 0, 8, 1]  # 2-3 | 4-5 cross an extent edge; 8-9 is the short last extent
    out = torch.empty(len(slots) * BB, dtype=torch.uint8)
    tier.gather(slots, out)
    assert [int(block[0]) for block in out.view(-1, BB)] == slots
    tier.scatter(list(reversed(slots)), out)  # the same bytes, block i into slot reversed(slots)[i]
    assert [int(tier.view(s)[0]) for s in reversed(slots)] == slots


def test_gather_into_rows_places_each_block_in_its_row_and_keeps_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(10, 4, monkeypatch)
    fill(tier)
    sizes = count_memmoves(monkeypatch)
    out = torch.zeros(6, BB, dtype=torch.uint8)
    tier.gather([5, 6, 7, 1], out, rows=[0, 1, 3, 5])   # 5-6 to rows 0-1 in one copy; 7 and 1 alone
    assert [int(block[0]) for block in out] == [5, 6, 0, 7, 0, 1]
    assert sizes == [2 * BB, BB, BB]
    with pytest.raises(ValueError, match="6 x 1024"):
        tier.gather([0], torch.empty(5, BB, dtype=torch.uint8), rows=[5])


@pytest.mark.parametrize("block_bytes", [4096, 12288, 1024])
def test_buffers_are_numpy_views_of_the_slots_aligned_where_the_tier_says(block_bytes: int) -> None:
    tier = MemoryTier("cpu", Medium.CPU, torch.device("cpu"), block_bytes, 20 * block_bytes)
    assert tier.aligned_slots == (block_bytes % 4096 == 0)
    bufs = tier.buffers([3, 0, 19])
    for slot, buf in zip([3, 0, 19], bufs):
        assert buf.shape == (block_bytes,) and buf.dtype == np.uint8 and buf.flags.c_contiguous
        buf[:] = slot + 1
        assert int(tier.view(slot)[0]) == slot + 1          # the same bytes, not a copy
        if tier.aligned_slots:
            assert buf.ctypes.data % 4096 == 0
    with pytest.raises(IndexError, match="slot=20"):
        tier.buffers([20])


def test_copy_slots_moves_each_block_into_the_other_tiers_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = make(10, 4, monkeypatch), make(12, 4, monkeypatch)
    fill(src)
    src.copy_slots([9, 0, 4, 3], dst, [11, 5, 0, 6])   # across extents, into a tier of another size
    assert [int(dst.view(d)[0]) for d in (11, 5, 0, 6)] == [9, 0, 4, 3]
    assert torch.equal(dst.view(11), src.view(9))
    assert dst.pool.used == 0 and src.pool.used == 0          # bytes only: the pools are the caller's
    with pytest.raises(IndexError, match="slot=12"):
        src.copy_slots([0], dst, [12])


def test_adjacent_slots_move_as_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(16, 8, monkeypatch)
    fill(tier)
    sizes = count_memmoves(monkeypatch)
    tier.gather([0, 1, 2, 6, 7, 8, 9, 3], torch.empty(8 * BB, dtype=torch.uint8))
    assert sizes == [3 * BB, 2 * BB, 2 * BB, BB]  # 6-7 | 8-9 split at the extent edge


def test_big_batches_share_runs_with_helpers_that_close_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "SPLIT_BYTES", 4 * BB)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    tier = make(64, 64, monkeypatch)
    fill(tier)
    slots = list(range(63, -1, -2)) + list(range(0, 64, 2))
    out = torch.empty(len(slots) * BB, dtype=torch.uint8)
    tier.gather(slots, out)
    assert [int(block[0]) for block in out.view(-1, BB)] == [s % 251 for s in slots]
    helpers = [t for t in threading.enumerate() if t.name.startswith("tierkv-cpu-copy")]
    assert 1 <= len(helpers) <= 2
    tier.close()
    assert not any(t.is_alive() for t in helpers)


def test_gather_refuses_wrong_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(8, 4, monkeypatch)
    with pytest.raises(ValueError, match="expected 2 x 1024 = 2048 contiguous bytes"):
        tier.gather([0, 1], torch.empty(BB, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous=False"):
        tier.gather([0, 1], torch.empty(2 * BB, 2, dtype=torch.uint8)[:, 0])
    with pytest.raises(IndexError, match="slot=8"):
        tier.gather([7, 8], torch.empty(2 * BB, dtype=torch.uint8))
    tier.gather([1], torch.empty(BB // 4, dtype=torch.int32))  # any dtype: only the bytes count


def test_small_blocks_copy_by_index_into_rows_growing_extents_and_checking_slots(monkeypatch) -> None:
    tier = make(10, 4, monkeypatch, indexed=True)
    sizes = count_memmoves(monkeypatch)
    src = torch.arange(3, dtype=torch.uint8).repeat_interleave(BB).view(3, BB) + 100
    tier.scatter([9, 0, 5], src)                 # the last extent first: extents are made as needed
    assert tier.allocated_bytes == 10 * BB
    assert [int(tier.view(s)[0]) for s in (9, 0, 5)] == [100, 101, 102]
    out = torch.zeros(6, BB, dtype=torch.uint8)
    tier.gather([5, 9, 0], out, rows=[4, 0, 2])
    assert [int(block[0]) for block in out] == [100, 0, 101, 0, 102, 0]
    tier.scatter([1, 2], src[:2] + 10)
    tier.gather([2, 0, 1], out[1:4])             # one extent into a run of rows: one indexed copy in place
    tier.gather([5, 9], out, rows=[4, 5])        # a run of rows over two extents
    assert [int(block[0]) for block in out] == [100, 111, 101, 110, 102, 100]
    assert sizes == []                           # no memmove per block
    with pytest.raises(IndexError, match="slot=10"):
        tier.gather([1, 10], torch.zeros(2, BB, dtype=torch.uint8))
