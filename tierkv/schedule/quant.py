"""4-bit group quantization of offloaded KV (FlexGen's compression), and its measured error.

Consecutive values (the last dimension first: one head's vector when the head dim is 64) are cut
into groups of ``GROUP``; each group keeps its minimum and its
scale in float16 and each value a 4-bit code, two codes per byte::

    x [..., D]  ->  groups [numel/G, G]
    lo = min(group), scale = (max - lo) / 15
    code = round((x - lo) / scale)  in 0..15           x' = lo + code * scale
    bytes per group: G/2 codes + 2 (lo) + 2 (scale)     (G=64: 36 bytes vs 128 in bf16, 256 in fp32)

``pack`` writes codes, minima and scales one after another into a flat uint8 tensor, so a
quantized K/V pair fits one fixed-size block of the tiers.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

GROUP = 64
LEVELS = 15


def packed_bytes(numel: int, group: int = GROUP) -> int:
    """Bytes of ``pack`` for a tensor of ``numel`` values (a multiple of ``group``)."""
    groups = numel // group
    return numel // 2 + 4 * groups


def pack(x: Tensor, group: int = GROUP) -> Tensor:
    """x (numel a multiple of ``group``) -> flat uint8 of ``packed_bytes(x.numel())``."""
    if x.numel() % group:
        raise ValueError(f"{x.numel()} values are not a multiple of the group {group}")
    g = x.contiguous().reshape(-1, group).float()                                   # [N, G]
    lo = g.amin(dim=1, keepdim=True)
    scale = ((g.amax(dim=1, keepdim=True) - lo) / LEVELS).clamp_min(1e-8)
    lo16, scale16 = lo.half(), scale.half()
    codes = ((g - lo16.float()) / scale16.float()).round_().clamp_(0, LEVELS).to(torch.uint8)
    nibbles = codes[:, 0::2] | (codes[:, 1::2] << 4)                   # [N, G/2]
    return torch.cat([nibbles.reshape(-1), lo16.reshape(-1).view(torch.uint8),
                      scale16.reshape(-1).view(torch.uint8)])


def unpack(raw: Tensor, shape: tuple[int, ...], dtype: torch.dtype, group: int = GROUP) -> Tensor:
    """Inverse of ``pack``: flat uint8 -> a tensor of ``shape`` in ``dtype``."""
    numel = math.prod(shape)
    n = numel // group
    nibbles = raw[:numel // 2].reshape(n, group // 2)
    lo = raw[numel // 2:numel // 2 + 2 * n].view(torch.float16).float().unsqueeze(1)
    scale = raw[numel // 2 + 2 * n:numel // 2 + 4 * n].view(torch.float16).float().unsqueeze(1)
    codes = torch.stack([nibbles & 0xF, nibbles >> 4], dim=2).reshape(n, group).float()
    return (lo + codes * scale).to(dtype).reshape(shape)


def relative_error(x: Tensor, group: int = GROUP) -> float:
    """``||x - unpack(pack(x))|| / ||x||``: what 4-bit storage costs on these values."""
    back = unpack(pack(x, group), tuple(x.shape), torch.float32, group)
    return float((x.float() - back).norm() / x.float().norm().clamp_min(1e-12))


class Group4:
    """This encoding as a `tierkv.layout.Codec`, for blocks whose fields are stored compressed."""

    def nbytes(self, numel: int) -> int:
        return packed_bytes(numel)

    def encode(self, x: Tensor) -> Tensor:
        return pack(x)

    def decode(self, raw: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return unpack(raw, shape, dtype)
