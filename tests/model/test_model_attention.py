"""attend / merge against a float64 reference over absolute positions."""
from __future__ import annotations

import math

import pytest
import torch

from tierkv.ops import attention
from tierkv.ops.attention import attend, merge, merge_lse


def reference(q, k, v, *, causal, q_offset=0):
    """Plain softmax attention in float64, GQA by repeating KV heads: (out, lse)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])     # [B, H, Tq, Tk]
    if causal:
        rows = torch.arange(q.shape[2])[:, None] + q_offset
        scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > rows, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v
    return out, lse


def qkv(B=2, H=6, Hkv=2, Tq=40, Tk=24, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g) * 2
    k = torch.randn(B, Hkv, Tk, D, generator=g) * 2
    v = torch.randn(B, Hkv, Tk, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.fixture(params=["cpu-flash", "matmul"])
def kernel(request, monkeypatch):
    """Run each test on both kernels: the CPU flash op and the portable fp32 fallback."""
    if request.param == "matmul":
        monkeypatch.setattr(attention, "_kernel", lambda *a: attention._attend_matmul)
    return request.param


def assert_close(got, want, atol=1e-5):
    out, lse = got
    ref_out, ref_lse = want
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=0)


def test_dense_matches_reference(kernel):
    q, k, v = qkv()
    assert_close(attend(q, k, v, causal=False), reference(q, k, v, causal=False))


@pytest.mark.parametrize("q_offset", [0, -8, -23, -24, -100, 5, 16, 23, 200])
def test_causal_offsets_match_reference(kernel, q_offset):
    q, k, v = qkv(Tq=40, Tk=24)
    assert_close(attend(q, k, v, causal=True, q_offset=q_offset), reference(q, k, v, causal=True, q_offset=q_offset))


def test_causal_on_own_chunk_masks_the_future(kernel):
    q, k, v = qkv(Tq=16, Tk=16)
    out, _ = attend(q, k, v, causal=True)
    v2 = v.clone()
    v2[:, :, 8:] += 100.0                       # later keys must not change earlier rows
    out2, _ = attend(q, k, v2, causal=True)
    assert torch.equal(out[:, :, :8], out2[:, :, :8])
    assert not torch.allclose(out[:, :, 8:], out2[:, :, 8:])


def test_rows_that_see_no_key_drop_out():
    q, k, v = qkv(Tq=10, Tk=4)
    out, lse = attend(q, k, v, causal=True, q_offset=-6)
    assert torch.all(out[:, :, :6] == 0) and torch.all(lse[:, :, :6] == -math.inf)
    assert torch.isfinite(lse[:, :, 6:]).all()


def test_decode_row_sees_every_key(kernel):
    q, k, v = qkv(Tq=1, Tk=300)
    assert_close(attend(q, k, v, causal=True, q_offset=299), reference(q, k, v, causal=False))


@pytest.mark.parametrize("block", [7, 16, 64])
def test_merge_over_blocks_equals_attention_over_concatenation(kernel, block):
    q, k, v = qkv(Tq=48, Tk=64)
    q_start = 16                                 # the query chunk holds positions 16..63
    parts = [attend(q, k[:, :, s:s + block], v[:, :, s:s + block], causal=True, q_offset=q_start - s)
             for s in range(0, 64, block)]
    want_out, want_lse = reference(q, k, v, causal=True, q_offset=q_start)
    out, lse = merge_lse(parts)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(merge(parts), out, atol=0, rtol=0)


def test_running_merge_equals_merge_of_all():
    q, k, v = qkv(Tq=8, Tk=40)
    parts = [attend(q, k[:, :, s:s + 8], v[:, :, s:s + 8], causal=False) for s in range(0, 40, 8)]
    acc = parts[0]
    for part in parts[1:]:
        acc = merge_lse([acc, part])
    torch.testing.assert_close(acc[0], merge(parts), atol=1e-5, rtol=0)


def test_merge_of_only_empty_rows_is_zero():
    q, k, v = qkv(Tq=4, Tk=4)
    parts = [attend(q, k, v, causal=True, q_offset=-10)] * 2
    out, lse = merge_lse(parts)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_merge_needs_a_part():
    with pytest.raises(ValueError):
        merge([])


def test_bf16_keeps_dtype_and_fp32_lse(kernel):
    q, k, v = qkv(dtype=torch.bfloat16)
    out, lse = attend(q, k, v, causal=True, q_offset=10)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close((out, lse), reference(q, k, v, causal=True, q_offset=10), atol=3e-2)


def test_heads_must_fold_into_kv_groups():
    q, k, v = qkv(H=5, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        attend(q, k, v, causal=False)


def test_a_key_mask_per_kv_head_equals_attending_to_each_heads_keys_alone():
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    keep = [torch.tensor([0, 3, 4, 9]), torch.arange(10)]
    mask = torch.full((1, 2, 1, 10), float("-inf"))
    for h, rows in enumerate(keep):
        mask[0, h, 0, rows] = 0.0
    out, lse = attend(q, k, v, causal=False, mask=mask)
    for h, rows in enumerate(keep):
        want, want_lse = attend(q[:, 3 * h:3 * h + 3], k[:, h:h + 1, rows], v[:, h:h + 1, rows], causal=False)
        assert torch.allclose(out[:, 3 * h:3 * h + 3], want, atol=1e-6)
        assert torch.allclose(lse[:, 3 * h:3 * h + 3], want_lse, atol=1e-5)
    with pytest.raises(ValueError, match="non-causal"):
        attend(q, k, v, causal=True, mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_put_rows_writes_what_torch_indexing_writes(dtype):
    import numpy as np
    from tierkv.ops.rows import put_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12, 8, generator=g).to(dtype)
    window = x[:, 2:10].view(3, 4, 16)                  # a strided view, as a context's chunk rows are
    heads, at = np.arange(3)[:, None], np.array([[0, 3], [1, 2], [3, 0]])
    rows = torch.randn(3, 2, 16, generator=g)
    want = x.clone()
    want[:, 2:10].view(3, 4, 16)[torch.from_numpy(heads), torch.from_numpy(at)] = rows.to(dtype)
    put_rows(window, (heads, at), rows.to(dtype))       # same dtype: numpy over the bytes
    assert torch.equal(x, want)
    put_rows(window, (heads, at), rows * 2)             # another dtype: torch's indexing, cast
    want[:, 2:10].view(3, 4, 16)[torch.from_numpy(heads), torch.from_numpy(at)] = (rows * 2).to(dtype)
    assert torch.equal(x, want)
    flat, late = x.view(-1, 8), np.array([0, 5, 35])
    put_rows(flat, late)                                # zeros: +0.0, as index_fill_ writes
    assert torch.equal(x, want.view(-1, 8).index_fill_(0, torch.from_numpy(late), 0).view(3, 12, 8))
    assert not torch.signbit(flat[late].float()).any()
