"""Rotary position embedding (transformers' rotate-half convention), and a table of it by position.

``RopeTable`` keeps cos/sin (float32) for positions 0..n-1 of one model, made by the model's own
rotary embedding (so scaled variants match) and grown on use: a step over compact or real
positions reads rows of it instead of recomputing them, in the keys' dtype (a bf16 copy of the
table, made once)::

    table = RopeTable(lambda positions: rope_cos_sin(model, positions), head_dim)
    cos, sin = table.span(start, n)           [1, n, D]   views, no gather
    cos, sin = table.at(positions)            [*positions.shape, D]
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D], cos/sin [B, T, D] -> x rotated (transformers' rotate-half convention), in the
    dtype the two promote to. Mixed dtypes are cast once up front: PyTorch's CPU kernels convert them
    element by element in every op (bf16 keys by float32 cos/sin: 10x slower, the same values)."""
    if x.dtype != cos.dtype:
        common = torch.promote_types(x.dtype, cos.dtype)
        x, cos, sin = x.to(common), cos.to(common), sin.to(common)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                 # [B, 1, T, D]
    half = x.shape[-1] // 2     # x*cos + rotate_half(x)*sin with no rotated copy of x, rounded as it is
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def unrope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inverse of ``apply_rope``: the pre-RoPE keys, exact up to fp error.

    Each pair (x1, x2) was turned by the matrix [[c, -s], [s, c]]; its inverse is the transpose
    divided by c^2 + s^2 (1 for plain RoPE, attention_scaling^2 for yarn-style variants).
    """
    xf = x.float()                                                # fp32: bf16 would add error
    cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)  # [B, 1, T, D]
    return ((xf * cos - _rotate_half(xf) * sin) / (cos * cos + sin * sin)).to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RopeTable:
    """cos, sin (float32) by position, from ``make(positions [n]) -> (cos, sin) [1, n, D]``."""

    def __init__(self, make: Callable[[Tensor], tuple[Tensor, Tensor]], head_dim: int) -> None:
        self._make = make
        self._cos = self._sin = torch.empty(0, head_dim)
        self._narrow: dict[object, tuple[Tensor, Tensor]] = {}    # the table in other dtypes (and signed)

    def at(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos, sin [*positions.shape, D], in ``dtype``."""
        self._grow(int(positions.max()) + 1 if positions.numel() else 0)
        cos, sin = self._table(dtype)      # index_select of the rows: 6x the speed of cos[positions]
        flat, shape = positions.reshape(-1), (*positions.shape, cos.shape[-1])
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)

    def span(self, start: int, n: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos, sin [1, n, D] of positions start .. start+n-1: views of the table (in ``dtype``: of a
        copy of it in that dtype, made once)."""
        self._grow(start + n)
        cos, sin = self._table(dtype)
        return cos[start:start + n].unsqueeze(0), sin[start:start + n].unsqueeze(0)

    def rotate_span(self, x: Tensor, start: int) -> Tensor:
        """x [B, H, T, D] rotated to positions start .. start+T-1, in its own dtype: one product and one
        fused multiply-add of the swapped halves by a signed sine table (made once), 0.74 against 0.94 ms
        for 8.7K bf16 keys of 3 heads. It rounds once where `apply_rope` (transformers' order of
        operations) rounds twice: for keys no dense reference is compared with (compact positions)."""
        n, half = x.shape[-2], x.shape[-1] // 2
        self._grow(start + n)
        if (x.dtype, "signed") not in self._narrow:
            cos, sin = self._table(x.dtype)
            self._narrow[(x.dtype, "signed")] = (cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=1))
        cos, signed = self._narrow[(x.dtype, "signed")]
        return torch.addcmul(x * cos[start:start + n], x.roll(half, -1), signed[start:start + n])

    def rotate_heads(self, k_pre: Tensor, positions: Tensor) -> Tensor:
        """k_pre [Hkv, T, D] rotated to per-head positions [Hkv, T], in its own dtype (bf16 keys as the
        model rotates them; widened to float32 for it they took several times as long)."""
        if positions.shape[0] > 1 and torch.equal(positions[1:], positions[:1].expand(positions.shape[0] - 1, -1)):
            positions = positions[:1]                                # the same for every head: one table
        cos, sin = self.at(positions, k_pre.dtype)                   # [Hkv or 1, T, D]
        return apply_rope(k_pre.unsqueeze(1), cos, sin).squeeze(1)

    def rotate_tokens(self, k_pre: Tensor, positions: Tensor) -> Tensor:
        """k_pre [t, Hkv, D] at positions [t] -> keys after RoPE [t, Hkv, D] (float32)."""
        cos, sin = self.at(positions.unsqueeze(0))                   # [1, t, D]
        return apply_rope(k_pre.transpose(0, 1).unsqueeze(0).float(), cos, sin)[0].transpose(0, 1)

    def _table(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The whole table in ``dtype`` (other than float32: a copy made once, until the table grows)."""
        if dtype == torch.float32:
            return self._cos, self._sin
        if dtype not in self._narrow:
            self._narrow[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        return self._narrow[dtype]

    def _grow(self, top: int) -> None:
        if top > self._cos.shape[0]:
            size = max(top, 2 * self._cos.shape[0], 4096)
            cos, sin = self._make(torch.arange(size))
            self._cos, self._sin = cos[0].float(), sin[0].float()
            self._narrow.clear()
