import pytest
import torch

from tierkv.schedule import quant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_four_bit_groups_round_trip_within_their_step(dtype):
    x = torch.randn(3, 2, 16, 64).to(dtype)
    raw = quant.pack(x)
    assert raw.dtype == torch.uint8 and raw.numel() == quant.packed_bytes(x.numel())
    back = quant.unpack(raw, tuple(x.shape), dtype)
    groups = x.float().reshape(-1, 64)
    step = (groups.amax(1) - groups.amin(1)) / 15                      # one code step per group
    err = (back.float() - x.float()).reshape(-1, 64).abs().amax(1)
    rounding = groups.abs().amax(1) * torch.finfo(dtype).eps        # the result is rounded to dtype
    assert torch.all(err <= step / 2 + 1e-2 * step + rounding + 1e-6)


def test_measured_error_is_small_but_not_zero():
    x = torch.randn(4, 4, 32, 64)
    err = quant.relative_error(x)
    assert 0.01 < err < 0.15


def test_four_bits_take_a_quarter_of_bf16_plus_scales():
    assert quant.packed_bytes(64) == 32 + 4
    with pytest.raises(ValueError, match="multiple of the group"):
        quant.pack(torch.zeros(2, 20))
