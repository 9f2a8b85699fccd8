"""What one block holds: named fields back to back, padded to the store's alignment.

Every block tierkv moves between tiers has one of three layouts, all of this one class::

    dense KV block  (kv)      k [B, Hkv, T, D] | v [B, Hkv, T, D]          | pad to 4 KiB
    sparse page     (page)    values [P, Hkv, D] | factors [P, r]          | pad to 4 KiB
    batch KV block  (batch)   k [rows, Hkv, T, D] | v [rows, Hkv, T, D]    | pad to 4 KiB  (or 4-bit groups)

``pack`` writes tensors into a block's bytes; ``unpack`` gives views of them
(no copy), for one block (``raw`` [block_bytes]) or many (``raw`` [n, block_bytes],
every view gaining a leading ``n``). A field may be stored through a ``Codec``
(the batch path's 4-bit groups, `tierkv.schedule.quant`); such a field is
decoded, not viewed.

A page is the read unit of sparse decode. Selection picks 8-token chunks, but a read that small
wastes the device (O_DIRECT wants 4 KiB multiples; SmolLM2's values are 384 B per token in bf16),
so a page groups whole chunks of one layer, values and low-rank key factors together, and one read
brings everything needed to rebuild and attend to them (SmolLM2, bf16, P = 16, r = 192: 6 KiB of
values + 6 KiB of factors = 12 KiB).

A layout's ``name`` names its store (one namespace per layout): the names
are those earlier releases used, so stores they wrote stay readable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from tierkv.device import align_up


class Codec(Protocol):
    """A lossy encoding of a field's values into bytes (instead of the layout's dtype)."""

    def nbytes(self, numel: int) -> int: ...

    def encode(self, x: Tensor) -> Tensor: ...                     # -> flat uint8 [nbytes(x.numel())]

    def decode(self, raw: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    shape: tuple[int, ...]
    codec: Codec | None = None       # None: stored as the layout's dtype, and read as a view

    def nbytes(self, dtype: torch.dtype) -> int:
        numel = math.prod(self.shape)
        return numel * dtype.itemsize if self.codec is None else self.codec.nbytes(numel)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The fields of one block, in the dtype the block stores, and the shape figures callers read."""

    name: str                       # names the block's store: one namespace per layout
    fields: tuple[Field, ...]
    dtype: torch.dtype
    tokens: int                     # tokens per block (a page's page_tokens)
    num_kv_heads: int
    head_dim: int
    rank: int = 0                   # page: key factors per token
    batch: int = 1                  # kv / batch: sequences side by side
    num_layers: int = 0             # kv: layers of the model (names the store)
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tokens", "num_kv_heads", "head_dim", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        offsets, at = [], 0
        for f in self.fields:
            offsets.append(at)
            at += f.nbytes(self.dtype)
        object.__setattr__(self, "_offsets", (*offsets, at))

    # -- the three layouts ---------------------------------------------------------------
    @classmethod
    def kv(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           block_tokens: int = 256, batch: int = 1) -> BlockLayout:
        """K and V of ``block_tokens`` tokens of one layer, post-RoPE, as the dense loop attends them."""
        half = (batch, num_kv_heads, block_tokens, head_dim)
        name = f"kv-L{num_layers}-H{num_kv_heads}-D{head_dim}-T{block_tokens}-B{batch}-{_dtype_name(dtype)}"
        return cls(name, (Field("k", half), Field("v", half)), dtype, block_tokens, num_kv_heads, head_dim,
                   batch=batch, num_layers=num_layers)

    @classmethod
    def page(cls, page_tokens: int, num_kv_heads: int, head_dim: int, rank: int,
             dtype: torch.dtype) -> BlockLayout:
        """Values and low-rank key factors of ``page_tokens`` tokens of one layer (sparse decode)."""
        fields = (Field("values", (page_tokens, num_kv_heads, head_dim)), Field("factors", (page_tokens, rank)))
        name = f"sparse-P{page_tokens}-H{num_kv_heads}-D{head_dim}-R{rank}-{_dtype_name(dtype)}"
        return cls(name, fields, dtype, page_tokens, num_kv_heads, head_dim, rank=rank)

    @classmethod
    def batch_kv(cls, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_tokens: int, rows: int, *,
                 codec: Codec | None = None) -> BlockLayout:
        """K and V of ``rows`` sequences of a batch (``codec``: stored compressed, lossy)."""
        half = (rows, num_kv_heads, block_tokens, head_dim)
        name = f"batch-H{num_kv_heads}-D{head_dim}-T{block_tokens}-B{rows}-{_dtype_name(dtype)}"
        return cls(name, (Field("k", half, codec), Field("v", half, codec)), dtype, block_tokens,
                   num_kv_heads, head_dim, batch=rows)

    def with_rows(self, rows: int) -> BlockLayout:
        """A batch layout for ``rows`` of its sequences (a smaller GPU batch packs into a block of the
        full layout's size: its V starts where its own K ends)."""
        return BlockLayout.batch_kv(self.num_kv_heads, self.head_dim, self.dtype, self.tokens, rows,
                                    codec=self.fields[0].codec)

    # -- sizes and names --------------------------------------------------------------------
    @property
    def payload_bytes(self) -> int:
        return self._offsets[-1]

    @property
    def block_bytes(self) -> int:
        return align_up(self.payload_bytes)

    # -- bytes -------------------------------------------------------------------------------
    def pack(self, *parts: Tensor, out: Tensor | None = None) -> Tensor:
        """One tensor per field, in field order -> uint8 [block_bytes] (``out``, or zeros)."""
        if len(parts) != len(self.fields):
            raise ValueError(f"{len(parts)} tensors for the {len(self.fields)} fields of a {self.name} block")
        raw = torch.zeros(self.block_bytes, dtype=torch.uint8) if out is None else out
        for f, start, end, part in zip(self.fields, self._offsets, self._offsets[1:], parts):
            if f.codec is not None:
                raw[start:end].copy_(f.codec.encode(part))
            else:
                raw[start:end].view(self.dtype).view(part.shape).copy_(part)
        return raw

    def unpack(self, raw: Tensor) -> tuple[Tensor, ...]:
        """uint8 [block_bytes] or [n, block_bytes] -> one tensor per field ([*field.shape], or
        [n, *field.shape]): views into ``raw``; a field with a codec is decoded (a copy; one block at a time)."""
        lead = tuple(raw.shape[:-1])
        views = []
        for f, start, end in zip(self.fields, self._offsets, self._offsets[1:]):
            part = raw[..., start:end]
            views.append(part.view(self.dtype).view(*lead, *f.shape) if f.codec is None
                         else f.codec.decode(part, (*lead, *f.shape), self.dtype))
        return tuple(views)

    def field_bytes(self, name: str) -> int:
        """Bytes of the field ``name`` in one block."""
        i = next(i for i, f in enumerate(self.fields) if f.name == name)
        return self._offsets[i + 1] - self._offsets[i]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
