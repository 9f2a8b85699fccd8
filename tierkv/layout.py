"""What one block holds: named fields back to back, padded to the store's alignment.

Every block tierkv moves between tiers has one of three layouts, all of this one class::

    dense KV block  (kv)      k [B, Hkv, T, D] | v [B, Hkv, T, D]          | pad to 4 KiB
    sparse page     (page)    values [P, Hkv, D] | factors [P, r]          | pad to 4 KiB
    batch KV block  (batch)   k [rows, Hkv, T, D] | v [rows, Hkv, T, D]    | pad to 4 KiB

``pack`` writes tensors into a block's bytes; ``unpack`` gives views of them
(no copy), for one block (``raw`` [block_bytes]) or many (``raw`` [n, block_bytes],
every view gaining a leading ``n``). Any layout may store its fields quantized
(``tierkv.codec``: keys per channel, values per token, int8 / int4 / int2); such a
field is decoded, not viewed, and ``take`` decodes only the rows a read gathers.

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
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from tierkv.codec import KVCodec
from tierkv.device import align_up


Index = Tensor | np.ndarray      # integer indexes of a take: CPU tensors or numpy arrays


class Codec(Protocol):
    """A lossy encoding of a field's values into bytes (instead of the layout's dtype)."""

    name: str

    def nbytes(self, shape: tuple[int, ...]) -> int: ...

    def encode(self, x: Tensor, out: Tensor | None = None, *, blocks: int = 0) -> Tensor: ...   # -> uint8 bytes

    def decode(self, raw: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor: ...

    def take(self, raw: Tensor, shape: tuple[int, ...], index: tuple[Tensor, ...]) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    shape: tuple[int, ...]
    codec: Codec | None = None       # None: stored as the layout's dtype, and read as a view

    def nbytes(self, dtype: torch.dtype) -> int:
        if self.codec is None:
            return math.prod(self.shape) * dtype.itemsize
        return self.codec.nbytes(self.shape)


_LAYOUT_NAME = re.compile(r"(kv-L\d+|sparse-P\d+|batch)-H\d+-D\d+-")


def is_layout_name(name: str) -> bool:
    """Whether ``name`` has the form of a layout's (``BlockLayout.name``): what tierkv names a store's folder."""
    return _LAYOUT_NAME.match(name) is not None


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
    codec: KVCodec | None = None    # how the fields are quantized (None: stored in ``dtype``)
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
           block_tokens: int = 256, batch: int = 1, *, codec: KVCodec | None = None) -> BlockLayout:
        """K and V of ``block_tokens`` tokens of one layer, post-RoPE, as the dense loop attends them
        (``codec``: stored quantized, read back in ``dtype``)."""
        half = (batch, num_kv_heads, block_tokens, head_dim)
        fields = _kv_fields(half, codec)
        name = f"kv-L{num_layers}-H{num_kv_heads}-D{head_dim}-T{block_tokens}-B{batch}-{_dtype_name(dtype)}"
        return cls(name + _codec_suffix(fields), fields, dtype, block_tokens, num_kv_heads, head_dim,
                   batch=batch, num_layers=num_layers, codec=codec)

    @classmethod
    def page(cls, page_tokens: int, num_kv_heads: int, head_dim: int, rank: int,
             dtype: torch.dtype, *, codec: KVCodec | None = None) -> BlockLayout:
        """Values and low-rank key factors of ``page_tokens`` tokens of one layer (sparse decode);
        ``codec``: values per token, the key factors per channel over the page's tokens."""
        values, factors = (page_tokens, num_kv_heads, head_dim), (page_tokens, rank)
        fields = (Field("values", values, codec and codec.values(values, head_dim)),
                  Field("factors", factors, codec and codec.keys(factors)))
        name = f"sparse-P{page_tokens}-H{num_kv_heads}-D{head_dim}-R{rank}-{_dtype_name(dtype)}"
        return cls(name + _codec_suffix(fields), fields, dtype, page_tokens, num_kv_heads, head_dim, rank=rank,
                   codec=codec)

    @classmethod
    def batch_kv(cls, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_tokens: int, rows: int, *,
                 codec: KVCodec | None = None) -> BlockLayout:
        """K and V of ``rows`` sequences of a batch (``codec``: stored quantized, lossy)."""
        half = (rows, num_kv_heads, block_tokens, head_dim)
        fields = _kv_fields(half, codec)
        name = f"batch-H{num_kv_heads}-D{head_dim}-T{block_tokens}-B{rows}-{_dtype_name(dtype)}"
        return cls(name + _codec_suffix(fields), fields, dtype, block_tokens, num_kv_heads, head_dim,
                   batch=rows, codec=codec)

    def with_rows(self, rows: int) -> BlockLayout:
        """A batch layout for ``rows`` of its sequences (a smaller GPU batch packs into a block of the
        full layout's size: its V starts where its own K ends)."""
        return BlockLayout.batch_kv(self.num_kv_heads, self.head_dim, self.dtype, self.tokens, rows,
                                    codec=self.codec)


    # -- sizes and names --------------------------------------------------------------------
    @property
    def payload_bytes(self) -> int:
        return self._offsets[-1]

    @property
    def block_bytes(self) -> int:
        return align_up(self.payload_bytes)

    # -- bytes -------------------------------------------------------------------------------
    def pack(self, *parts: Tensor, out: Tensor | None = None) -> Tensor:
        """One tensor per field, in field order -> uint8 [block_bytes] (``out``, or zeros); tensors with
        one more leading dimension than their fields are that many blocks -> uint8 [n, block_bytes]."""
        if len(parts) != len(self.fields):
            raise ValueError(f"{len(parts)} tensors for the {len(self.fields)} fields of a {self.name} block")
        blocks = parts[0].dim() - len(self.fields[0].shape)
        lead = tuple(parts[0].shape[:blocks])
        raw = torch.zeros(*lead, self.block_bytes, dtype=torch.uint8) if out is None else out
        for f, start, end, part in zip(self.fields, self._offsets, self._offsets[1:], parts):
            if f.codec is not None:
                f.codec.encode(part, out=raw[..., start:end], blocks=blocks)
            else:
                raw[..., start:end].view(self.dtype).view(*lead, *f.shape).copy_(part)
        return raw

    def unpack(self, raw: Tensor) -> tuple[Tensor, ...]:
        """uint8 [block_bytes] or [n, block_bytes] -> one tensor per field ([*field.shape], or
        [n, *field.shape]): views into ``raw``; a quantized field is decoded (a copy)."""
        lead = tuple(raw.shape[:-1])
        views = []
        for f, start, end in zip(self.fields, self._offsets, self._offsets[1:]):
            part = raw[..., start:end]
            views.append(part.view(self.dtype).view(*lead, *f.shape) if f.codec is None
                         else f.codec.decode(part, (*lead, *f.shape), self.dtype))
        return tuple(views)

    def take(self, raw: Tensor, name: str, index: tuple[Index, ...], *, split: int | None = None) -> Tensor:
        """Rows of the field ``name`` of blocks ``raw`` [n, block_bytes], in the layout's dtype (a quantized
        field: decoded to float32): ``index`` has an integer tensor or array for each of the first
        dimensions of [n, *field shape] (at least the block's), and the result is [*index shape, the
        dimensions left]. ``split``: the field's last dimension seen as [-1, split] (a plain field only:
        one KV head's columns of the key factors). A quantized field decodes only those rows (its
        gather and its decode are one pass)."""
        i = next(i for i, f in enumerate(self.fields) if f.name == name)
        f, start = self.fields[i], self._offsets[i]
        part = raw[..., start:self._offsets[i + 1]]
        shape = f.shape if split is None else (*f.shape[:-1], f.shape[-1] // split, split)
        if f.codec is not None:
            if split is not None:
                raise ValueError(f"field {name!r} is quantized ({f.codec.name}): it is taken whole, not split")
            return f.codec.take(part, f.shape, tuple(map(_tensor, index)))
        left = shape[len(index) - 1:]
        row = math.prod(left) * self.dtype.itemsize
        if raw.dim() == 2 and raw.is_contiguous() and not start % row and not raw.shape[-1] % row:
            # each wanted row is `row` contiguous bytes: one index_select over the buffer seen as rows
            # (3x faster than indexing the strided field view in several dimensions); the rows'
            # offsets are worked out in numpy, whose calls on a few thousand integers cost a microsecond
            index = tuple(map(_array, index))
            flat, stride = index[0] * (raw.shape[-1] // row) + start // row, 1
            for size, idx in zip(reversed(shape[:len(index) - 1]), reversed(index[1:])):
                flat = flat + idx * stride
                stride *= size
            rows, index_shape = raw.view(-1).view(self.dtype).view(-1, math.prod(left)), flat.shape
            flat = torch.from_numpy(np.ascontiguousarray(flat).reshape(-1))
            return rows.index_select(0, flat).view(*index_shape, *left)
        return part.view(self.dtype).view(*raw.shape[:-1], *shape)[tuple(map(_tensor, index))]

    def row_table(self, raw: Tensor, *fields: tuple[str, int | None]) -> RowTable | None:
        """The plain fields (name, ``split`` as in ``take``), each [tokens, heads, D], of blocks ``raw``
        [n, block_bytes] as tables of rows that one index reads alike: block j's token t of head h is row
        ``j * per_block + t * per_token + h`` of each. None where a field's rows are not whole rows of
        the buffer (a quantized or unaligned field) or the fields' rows differ: ``take`` those."""
        views, geometry = [], set()
        for name, split in fields:
            i = next(i for i, f in enumerate(self.fields) if f.name == name)
            f, start = self.fields[i], self._offsets[i]
            shape = f.shape if split is None else (*f.shape[:-1], f.shape[-1] // split, split)
            row = shape[-1] * self.dtype.itemsize
            if f.codec is not None or len(shape) != 3 or raw.dim() != 2 or not raw.is_contiguous() \
                    or start % row or raw.shape[-1] % row:
                return None
            views.append(raw.view(-1).view(self.dtype).view(-1, shape[-1])[start // row:])
            geometry.add((shape[-1], raw.shape[-1] // row, shape[1]))
        if len(geometry) != 1:
            return None
        _, per_block, per_token = geometry.pop()
        return RowTable(tuple(views), per_block, per_token)

    def field_bytes(self, name: str) -> int:
        """Bytes of the field ``name`` in one block."""
        i = next(i for i, f in enumerate(self.fields) if f.name == name)
        return self._offsets[i + 1] - self._offsets[i]


class RowTable(NamedTuple):
    """Fields of many blocks as rows of one head's values (`BlockLayout.row_table`)."""

    fields: tuple[Tensor, ...]   # each [*, D], row 0 the first block's first token of head 0
    per_block: int
    per_token: int


class Blocks:
    """Blocks of one layout to ``take`` rows of, wherever they lie in one buffer [n, block_bytes]:
    copied there in order, or left in place (a tier's extent, block j being row ``rows[j]``).
    Taking in place moves only the rows wanted, no whole block (a 32K sparse step: 526 pages of
    12 KiB a layer, 1.2 ms copied then taken against 0.2 ms taken in place)::

        Blocks(layout, raw)                  block j = raw[j]
        Blocks(layout, extent, rows)         block j = extent[rows[j]]
    """

    def __init__(self, layout: BlockLayout, buffer: Tensor, rows: Index | None = None) -> None:
        self.layout, self.buffer, self.rows = layout, buffer, None if rows is None else _array(rows)

    @property
    def ids(self) -> np.ndarray:
        """Each block's row in the buffer."""
        return np.arange(len(self.buffer)) if self.rows is None else self.rows

    def row_table(self, *fields: tuple[str, int | None]) -> RowTable | None:
        """``BlockLayout.row_table`` of the buffer: block j's rows start at row ``ids[j] * per_block``."""
        return self.layout.row_table(self.buffer, *fields)

    def take(self, name: str, index: tuple[Index, ...], *, split: int | None = None) -> Tensor:
        """``BlockLayout.take`` over these blocks: ``index[0]`` numbers them 0..n-1."""
        if self.rows is not None:
            index = (self.rows[_array(index[0])], *index[1:])
        return self.layout.take(self.buffer, name, index, split=split)


def _array(index: Index) -> np.ndarray:
    return index if isinstance(index, np.ndarray) else index.numpy()


def _tensor(index: Index) -> Tensor:
    return index if isinstance(index, Tensor) else torch.from_numpy(index)


def _kv_fields(half: tuple[int, ...], codec: KVCodec | None) -> tuple[Field, Field]:
    """K per channel (each channel's scale over the block's tokens, or ``key_group`` of them), V per token."""
    if codec is None:
        return Field("k", half), Field("v", half)
    return Field("k", half, codec.keys(half)), Field("v", half, codec.values(half, half[-1]))


def _codec_suffix(fields: tuple[Field, ...]) -> str:
    codecs = [f.codec.name for f in fields if f.codec is not None]
    return "".join(f"-{c}" for c in dict.fromkeys(codecs))


def packed_page_tokens(codec: KVCodec, num_kv_heads: int, head_dim: int, rank: int, dtype: torch.dtype, *,
                       chunk_tokens: int = 8, most: int = 128, slack: float = 0.03) -> int:
    """Tokens per quantized page: a page is padded to 4 KiB, and a small quantized page is mostly
    padding and per-page key scales (int4, SmolLM2: 16 tokens cost 0.33 of bf16's bytes, 56 tokens
    0.29). The fewest whole chunks whose bytes per token come within ``slack`` of the least any
    page of up to ``most`` tokens reaches."""
    def per_token(tokens: int) -> float:
        layout = BlockLayout.page(tokens, num_kv_heads, head_dim, rank, dtype, codec=codec)
        return layout.block_bytes / tokens
    sizes = range(max(16, chunk_tokens), most + 1, chunk_tokens)
    best = min(per_token(p) for p in sizes)
    return next(p for p in sizes if per_token(p) <= best * (1 + slack))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
