"""Quantized KV (tierkv.codec): error bounds, bytes, packing, decoding only what a read gathers, and a
store that keeps what codec wrote it."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tierkv.codec import KVCodec, Quant
from tierkv.device import host_buffer
from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout, Blocks, packed_page_tokens
from tierkv.tiers.nvme import NvmeTier

H, D, R = 3, 64, 192          # SmolLM2-135M: KV heads, head dim, key factors per token


def sample(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values with outlier channels and an offset, as keys have."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.linspace(0.1, 8, shape[-1]) + 2


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("axis,shape,group", [("token", (16, 3, 64), 64), ("token", (1, 3, 256, 64), 32),
                                              ("channel", (56, 192), 56), ("channel", (1, 3, 256, 64), 64)])
@pytest.mark.parametrize("scale", [torch.float16, torch.bfloat16])
def test_every_value_is_within_half_a_step_of_its_group(bits, axis, shape, group, scale):
    q = Quant(bits, axis, group, scale)
    x = sample(shape)
    raw = q.encode(x)
    assert raw.dtype == torch.uint8 and raw.numel() == q.nbytes(shape) and raw.numel() % 4 == 0
    err = (q.decode(raw, shape, torch.float32) - x).abs()
    half = q.step_bound(raw, shape)
    assert torch.all(err <= half * (1 + 1e-5) + 1e-6)
    assert float(err.mean()) > 0          # lossy: a codec that stored the input would not be tested here


def test_fewer_bits_cost_more_error_and_save_bytes():
    x = sample((56, 192))
    errors, sizes = [], []
    for bits in (8, 4, 2):
        q = Quant(bits, "channel", 56)
        errors.append(float((q.decode(q.encode(x), x.shape, torch.float32) - x).abs().mean()))
        sizes.append(q.nbytes(tuple(x.shape)))
    assert errors[0] < errors[1] < errors[2]
    assert sizes[0] > sizes[1] > sizes[2]


@pytest.mark.parametrize("name,most", [("int8", 0.55), ("int4", 0.30), ("int2", 0.18)])
def test_a_quantized_page_packs_into_4k_blocks_at_its_share_of_bf16(name, most):
    codec = KVCodec.parse(name)
    tokens = packed_page_tokens(codec, H, D, R, torch.bfloat16)
    page = BlockLayout.page(tokens, H, D, R, torch.bfloat16, codec=codec)
    bf16 = BlockLayout.page(16, H, D, R, torch.bfloat16)
    assert page.block_bytes % 4096 == 0 and tokens % 8 == 0
    assert all(offset % 4 == 0 for offset in page._offsets)
    assert page.block_bytes / tokens <= most * bf16.block_bytes / 16
    assert page.name != bf16.name and name in page.name


@pytest.mark.parametrize("name", ["int8", "int4-g32", "int2-sbf16"])
def test_take_decodes_the_gathered_rows_as_a_whole_decode_would(name):
    layout = BlockLayout.page(56, H, D, R, torch.float32, codec=KVCodec.parse(name))
    raws = torch.stack([layout.pack(sample((56, H, D), i), sample((56, R), i + 9)) for i in range(4)])
    values, factors = layout.unpack(raws)                                  # [n, P, H, D], [n, P, R]
    page = torch.tensor([[3], [0], [2]]).unsqueeze(-1)                     # [H, k=1, 1]
    tok = torch.tensor([[8], [48], [0]]).unsqueeze(-1) + torch.arange(8)   # [H, 1, 8]: one chunk each
    heads = torch.arange(H).view(H, 1, 1)
    assert torch.equal(layout.take(raws, "factors", (page, tok)), factors[page, tok])
    assert torch.equal(layout.take(raws, "values", (page, tok, heads)), values[page, tok, heads])
    with pytest.raises(ValueError, match="quantized"):
        layout.take(raws, "factors", (page, tok, heads), split=D)
    flat_page, flat_tok = page.expand_as(tok).flatten(1), tok.flatten(1)   # rows one by one
    assert torch.equal(layout.take(raws, "factors", (flat_page, flat_tok)), factors[flat_page, flat_tok])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_take_of_plain_pages_gathers_the_rows_a_strided_index_would(dtype):
    layout = BlockLayout.page(16, H, D, R, dtype)
    raws = torch.stack([layout.pack(sample((16, H, D), i), sample((16, R), i + 9)) for i in range(5)])
    values, factors = layout.unpack(raws)
    page = torch.tensor([[4, 0], [2, 2], [1, 3]]).unsqueeze(-1)            # [H, 2, 1]
    tok = torch.tensor([[8, 0], [15, 3], [0, 7]]).unsqueeze(-1) + torch.arange(1)
    heads = torch.arange(H).view(H, 1, 1)
    got = layout.take(raws, "values", (page, tok, heads))
    assert got.dtype == dtype and torch.equal(got, values[page, tok, heads])      # the stored dtype, no copy to fp32
    assert torch.equal(layout.take(raws, "factors", (page, tok)), factors[page, tok])
    assert torch.equal(layout.take(raws, "values", (page, tok)), values[page, tok])    # [H, 2, 1, H, D]
    own = layout.take(raws, "factors", (page, tok, heads), split=D)       # each head's own columns
    assert torch.equal(own, factors.view(5, 16, R // D, D)[page, tok, heads])
    wide = torch.cat([raws, raws], 1)[:, :layout.block_bytes]             # not contiguous: the strided path
    assert not wide.is_contiguous() and torch.equal(layout.take(wide, "values", (page, tok, heads)), got)


def test_dense_blocks_quantize_keys_per_channel_in_64_token_groups():
    layout = BlockLayout.kv(30, H, D, torch.bfloat16, 256, codec=KVCodec.parse("int8", key_group=64))
    k_codec, v_codec = (f.codec for f in layout.fields)
    assert (k_codec.axis, k_codec.group, v_codec.axis, v_codec.group) == ("channel", 64, "token", 64)
    assert layout.block_bytes <= 0.55 * BlockLayout.kv(30, H, D, torch.bfloat16, 256).block_bytes
    k, v = sample((1, H, 256, D)), sample((1, H, 256, D), 1)
    back_k, _ = layout.unpack(layout.pack(k, v))
    assert back_k.dtype == torch.bfloat16 and float((back_k.float() - k).abs().max()) < 0.25


@pytest.mark.parametrize("text,message", [("int5", "allowed: float32"), ("int4-x3", "unknown option 'x3'"),
                                          ("int4-g0", "unknown option 'g0'"), ("int8-sf64", "unknown option")])
def test_a_codec_name_that_is_not_one_says_what_is(text, message):
    with pytest.raises(ConfigError, match=message):
        KVCodec.parse(text)


def test_a_group_that_does_not_divide_the_field_is_refused():
    with pytest.raises(ConfigError, match="-g48: must divide the 64 channels of a head"):
        BlockLayout.page(56, H, D, R, torch.bfloat16, codec=KVCodec.parse("int4-g48"))


def test_values_beyond_the_scale_dtype_are_refused_not_stored_as_inf():
    with pytest.raises(ConfigError, match="use a wider one"):
        Quant(8, "token", 64, torch.float16).encode(torch.full((2, 64), 1e6) * torch.arange(64))
    for bad in (math.nan, math.inf):                   # said as what it is, not as a range to widen
        with pytest.raises(ConfigError, match="NaN or inf"):
            Quant(8, "token", 64, torch.float32).encode(torch.full((2, 64), bad))


def test_a_store_written_with_one_codec_refuses_another(tmp_path: Path):
    int4 = BlockLayout.page(56, H, D, R, torch.bfloat16, codec=KVCodec.parse("int4"))
    int4_bf16_scales = BlockLayout.page(56, H, D, R, torch.bfloat16, codec=KVCodec.parse("int4-sbf16"))
    assert int4.block_bytes == int4_bf16_scales.block_bytes and int4.name != int4_bf16_scales.name
    with NvmeTier(tmp_path, int4.block_bytes, 8 * int4.block_bytes, namespace=int4.name):
        pass
    with pytest.raises(ConfigError, match="namespace"):
        NvmeTier(tmp_path, int4.block_bytes, 8 * int4.block_bytes, namespace=int4_bf16_scales.name)


def test_a_flipped_byte_in_the_scales_fails_the_checksum(tmp_path: Path):
    layout = BlockLayout.page(56, H, D, R, torch.bfloat16, codec=KVCodec.parse("int4"))
    factors_codec = layout.fields[1].codec
    codes, _ = factors_codec.parts(layout.fields[1].shape)
    scale_at = layout._offsets[1] + codes + 10                       # inside the key factors' scales
    key = BlockKey.of(b"doc", "page", 0, 0)
    with NvmeTier(tmp_path, layout.block_bytes, 8 * layout.block_bytes, namespace=layout.name) as tier:
        data = host_buffer(layout.block_bytes, pinned=False).copy_(layout.pack(sample((56, H, D)), sample((56, R))))
        slot = tier.pool.reserve()
        tier.write([(key, slot, data)])
        tier.pool.commit(slot)
        tier.flush()
        with open(tmp_path / "slots.dat", "r+b") as f:
            f.seek(slot * layout.block_bytes + scale_at)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
        back = host_buffer(layout.block_bytes, pinned=False)
        assert tier.read([(key, slot, back)]) == [key]


@pytest.mark.parametrize("name", [None, "int4"])
def test_blocks_left_in_place_take_what_the_copied_blocks_give(name):
    """Pages read where they lie (block j = extent[rows[j]]) give the rows the same pages copied out in
    order give: plain, a head's own columns, quantized."""
    layout = BlockLayout.page(16, H, D, R, torch.bfloat16, codec=None if name is None else KVCodec.parse(name))
    raws = torch.stack([layout.pack(sample((16, H, D), i), sample((16, R), i + 9)) for i in range(5)])
    extent = torch.zeros(9, layout.block_bytes, dtype=torch.uint8)
    rows = torch.tensor([7, 0, 3, 8, 5])
    extent[rows] = raws
    copied, in_place = Blocks(layout, raws), Blocks(layout, extent, rows)
    heads = torch.arange(H).view(H, 1, 1)
    page = torch.tensor([[4, 0], [2, 2], [1, 3]]).unsqueeze(-1)
    tok = torch.tensor([[8, 0], [14, 3], [0, 7]]).unsqueeze(-1) + torch.arange(2)
    for field, index in (("values", (page, tok, heads)), ("factors", (page, tok))):
        assert torch.equal(in_place.take(field, index), copied.take(field, index))
    if name is None:
        own = in_place.take("factors", (page, tok, heads), split=D)
        assert torch.equal(own, copied.take("factors", (page, tok, heads), split=D))
