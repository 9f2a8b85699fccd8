"""HostSpace: plain host tiers as ranges of one mapping, each slot a row of it."""
import pytest
import torch

from tierkv.config import TierConfig
from tierkv.errors import ConfigError
from tierkv.manager.build import build_tiers
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.memory import ZERO_ROW, HostSpace

BLOCK = 4096


def test_tiers_in_a_space_are_its_rows_and_a_late_claim_is_refused():
    space = HostSpace(BLOCK)
    gpu = GpuTier(BLOCK, 3 * BLOCK, torch.device("cpu"), space=space)
    cpu = CpuTier(BLOCK, 5 * BLOCK, space=space)
    assert (gpu.space_first, cpu.space_first, space.claimed) == (1, 4, 9)     # row 0: zeros, no tier's
    data = torch.arange(2 * BLOCK, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, BLOCK)
    gpu.scatter([2], data[0])
    cpu.scatter([4], data[1])
    rows = space.rows()
    assert rows.shape == (9, BLOCK) and rows.data_ptr() % 4096 == 0 and not rows[ZERO_ROW].any()
    assert torch.equal(rows[gpu.space_rows([2])[0]], data[0]) and torch.equal(rows[cpu.space_rows([4])[0]], data[1])
    assert cpu.space_rows([0, 4]).tolist() == [4, 8]
    with pytest.raises(IndexError, match="slot=5"):
        cpu.space_rows([5])
    with pytest.raises(RuntimeError, match="already mapped"):
        CpuTier(BLOCK, BLOCK, space=space)


def test_a_space_takes_only_plain_host_tiers_of_its_block_size():
    with pytest.raises(ValueError, match="8192-byte"):
        CpuTier(2 * BLOCK, 2 * BLOCK, space=HostSpace(BLOCK))
    with pytest.raises(ValueError, match="in no HostSpace"):
        CpuTier(BLOCK, BLOCK).space_rows([0])


def test_a_space_too_large_to_map_says_so():
    """More than the address space holds (1 PiB): a ConfigError naming the budgets, not a bare OSError,
    and from the tier manager's making, before any block is put."""
    space = HostSpace(2**30)
    space.claim(2**20)
    with pytest.raises(ConfigError, match="gpu and cpu budgets"):
        space.rows()
    with pytest.raises(ConfigError, match="could not be mapped"):
        build_tiers(TierConfig(block_bytes=BLOCK, gpu=BLOCK, cpu=200 * 2**40))
