"""A sparse read of a layer's pages: how `PageReader` reads them through the tier manager, and what
it gives back, the chosen tokens' keys and values and, for a split read (``SparseConfig.overlap``), a
``Loading`` that brings the rows of the pages still loading.

A read pins the pages, or, split, takes those in memory without a pin and leaves the rest
loading; pages pinned in one extent of a host tier are read in place, and so are a split read's
where the memory tiers share a ``HostSpace`` (the loaded ones too); others are copied out first.
Keys are rebuilt from each page's factors (the identity basis: the factors are the keys),
values taken as they are, each head's rows only (``tierkv.sparse.order.Placed`` says which)::

    SparseSequence._gather --chunks, Placed--> PageReader.read --> LayerRead (k, v, and what loads)
                                                     |
                             BlockingTierManager.read / acquire (the pages' bytes)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout, Blocks, Index
from tierkv.manager import BlockingTierManager, Lease
from tierkv.manager.lease import Lent
from tierkv.manager.read_future import ReadFuture
from tierkv.ops.rows import put_rows
from tierkv.sparse.layer_state import LayerState
from tierkv.sparse.lowrank import reconstruct
from tierkv.sparse.order import Placed
from tierkv.tiers.memory import ZERO_ROW


class Loading:
    """The chunk tokens of a ``gather_split`` whose pages were still loading when it returned::

        k, v, pos, loading = seq.gather_split(layer, chunks)
        attend to the rows where not loading.missing        (the missing ones are zeros)
        at, valid, k2, v2 = loading.finish()                 waits; the missing rows' keys and values
        attend to those

    ``finish`` returns them per KV head, padded to the largest count: ``at`` [Hkv, m] (rows of
    the gathered K, V), ``valid`` [Hkv, m] (False: padding), keys and values [Hkv, m, D] (as ``gather``).
    """

    def __init__(self, missing: Tensor, finish: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]],
                 abandon: Callable[[], None]) -> None:
        self.missing = missing          # [Hkv, M] bool, in the order of the gathered rows
        self._finish, self._abandon = finish, abandon
        self.done = False

    def finish(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.done:
            raise RuntimeError("Loading.finish: already finished or abandoned")
        self.done = True
        return self._finish()

    def abandon(self) -> None:
        """Not going to ``finish`` (an error on the way): the pages are released when they arrive."""
        if not self.done:
            self.done = True
            self._abandon()


@dataclass(slots=True)
class LayerRead:
    """A layer's chunks read from their pages into keys and values [Hkv, width, D], where ``place``
    says (the rows of no chunk are the caller's), and, for a split read, the pages still loading
    into ``blocks``."""
    k: Tensor
    v: Tensor
    place: Placed
    blocks: Blocks | None              # the pages, each in its row (a split read's: copied out, or lent)
    future: ReadFuture | None
    loading: Tensor | None = None      # [pages] bool: still loading into blocks


class PageReader:
    """Reads a layer's pages through the tier manager into the chosen tokens' keys and values."""

    def __init__(self, manager: BlockingTierManager, layout: BlockLayout) -> None:
        self.manager, self.layout = manager, layout

    def loading(self, state: LayerState, read: LayerRead, rows: Tensor) -> Loading:
        """What brings the gathered rows whose page ``read`` is still loading; ``rows`` [Hkv, M]:
        each gathered token's row in the read's pages (-1: an outlier, never missing)."""
        future, blocks, P = read.future, read.blocks, self.layout.tokens
        at_rows = rows.numpy()                     # numpy: torch's indexing and compares cost ~5x here
        missing = torch.from_numpy((at_rows >= 0) & read.loading.numpy()[np.maximum(at_rows, 0) // P])

        def finish() -> tuple[Tensor, Tensor, Tensor, Tensor]:
            future.wait()
            try:                               # lent in place: the loaded pages are rows of the space too
                loaded = blocks if future.extent is None else Blocks(self.layout, *future.extent)
                count = missing.sum(dim=1)                                            # [Hkv]
                at = np.argsort(~missing.numpy(), axis=1, kind="stable")[:, :int(count.max())]   # missing first
                at = torch.from_numpy(np.ascontiguousarray(at))
                valid = torch.arange(at.shape[1]) < count.unsqueeze(1)
                row = rows.gather(1, at).clamp(min=0)
                page, tok = row.div(P, rounding_mode="floor"), row % P
                heads = torch.arange(at.shape[0]).unsqueeze(1)
                keys = self._head_keys(state, loaded, page, tok, heads)                 # [Hkv, m, D]
                return at, valid, keys, loaded.take("values", (page, tok, heads))
            finally:
                future.release()
        return Loading(missing, finish, future.cancel)

    def read(self, state: LayerState, layer: int, pages: np.ndarray, place: Placed, *, tier: str | None,
             shared: bool = False, split: bool = False) -> LayerRead:
        """Pin ``pages`` (of ``state``, ascending) in ``tier``; rebuild each head's keys of its chunks
        only, into the rows ``place`` gives of K and V [Hkv, width, D], c rows a chunk (the other rows
        are the caller's)::

            rows[h]  = page slot * P + chunk offset in page * c + 0..c-1      [Hkv, k*c]
            K[h]     = A[rows[h]] @ B[:, h*D:(h+1)*D]                         [Hkv, k*c, D]
            V[h]     = values[rows[h], h]

        ``shared``: every head has the same chunks; their keys come from one product A[rows] @ B.
        Pages pinned in one extent of a host tier are read in place (only the rows wanted are
        copied; ``_read_lease``); otherwise they are copied out first, at most half the fastest
        tier at once. ``split``: pages not in memory are left loading (their rows zero; see
        ``SparseSequence.gather_split``); a read of more than half the fastest tier splits its last
        group only.
        """
        keys, step = [state.pages[p] for p in pages.tolist()], self.manager.pin_group(tier)
        if not split and len(keys) <= step:
            return self._read_pinned(state, layer, keys, place, tier, shared)
        raw = pages_buffer(len(pages), self.layout.block_bytes)
        # pinned at most half the fastest tier at once; split: the last group is left loading
        groups = [(first, first + step) for first in range(0, len(keys), step)]
        for first, end in groups[:-1] if split else groups:
            self.manager.read(keys[first:end], into=raw[first:end], tier=tier, layer=layer).wait()
        future = loading = placed = None
        if split:
            first = groups[-1][0]
            hints = state.row_hints(pages, self.manager.rows) if first == 0 else None
            for pin in (False, True):   # lent unpinned first: no hop to the manager's loop
                future = self.manager.read(keys[first:], into=raw[first:], tier=tier, layer=layer,
                                           lend=first == 0, pin=pin, rows=hints, packed=True)
                if future.rows is not None and first == 0:   # where the pages' rows are: the next step's guesses
                    state.page_rows[pages] = future.rows
                if future.lease is None:
                    break
                if future.missing:                # lent where they lie in a HostSpace, some loading
                    read = self._read_lent(state, future, place, shared)
                else:
                    read = self._read_lease(state, future.lease, future.extent, place, shared)
                if read is not None:              # every page in memory, in one extent: read there
                    return read
            placed = None if future.placed is None else np.concatenate((np.arange(first), first + future.placed))
            if not future.missing:
                future = None
        try:
            if future is not None:
                loading = torch.zeros(len(keys), dtype=torch.bool)
                loading[[first + row for row in future.missing]] = True
            blocks = Blocks(self.layout, raw, placed)        # (a packed read's rows: in place first)
            k, v = self._rebuild(state, place, blocks, shared)
            if loading is not None:   # the pages still loading hold whatever ``raw`` held: their rows are zeros
                k, v = self._zero_late(k, v, place, loading.numpy())
        except BaseException:
            if future is not None:
                future.cancel()
            raise
        return LayerRead(k, v, place, blocks, future, loading)

    def _read_pinned(self, state: LayerState, layer: int, keys: list[BlockKey], place: Placed,
                     tier: str | None, shared: bool) -> LayerRead:
        """``read`` of pages pinned at once: where they all lie in one extent of a host tier, their
        rows are taken there, no page copied whole; otherwise they are copied out first (a take
        over several buffers, measured, cost about what the copy does)."""
        lease = self.manager.acquire(keys, tier, layer=layer)
        try:
            found = lease.in_place()
        except BaseException:
            lease.release()
            raise
        return self._read_lease(state, lease, found, place, shared)

    def _read_lease(self, state: LayerState, lease: Lease | Lent, found: tuple[Tensor, np.ndarray] | None,
                    place: Placed, shared: bool) -> LayerRead | None:
        """``read`` of pages ``lease`` pins (or lends, ``Lent``), which it releases: ``found``
        (``Lease.in_place``) where they lie in one extent of a host tier, to be read there. None where
        lent pages moved while they were read (read them again, pinned)."""
        try:
            raw = None
            if found is not None:
                blocks = Blocks(self.layout, found[0], found[1])
            else:
                raw = pages_buffer(len(lease.keys), self.layout.block_bytes)
                self.manager.copy_out(lease, raw)
                blocks = Blocks(self.layout, raw)
            read = LayerRead(*self._rebuild(state, place, blocks, shared), place, blocks, None)
        except BaseException:
            lease.release()
            raise
        return read if lease.release() else None

    def _read_lent(self, state: LayerState, future: ReadFuture, place: Placed, shared: bool) -> LayerRead | None:
        """A split read whose pages ``future`` lends where they lie in a ``HostSpace`` (``future.extent``),
        some still loading: the rows of those in memory are taken there, those of the loading ones are
        zeros (taken from the space's zero row), and the future brings the rest (``loading``). None where
        lent pages moved while they were read (the future cancelled: read them again, pinned)."""
        space, at = future.extent
        late = at < 0
        try:
            blocks = Blocks(self.layout, space, np.where(late, ZERO_ROW, at))    # a loading page: zeros
            k, v = self._rebuild(state, place, blocks, shared)
            if not self._as_stored(state):    # keys rebuilt or decoded from the zero row: zero them
                k, v = self._zero_late(k, v, place, late)
        except BaseException:
            future.lease.release()
            future.cancel()
            raise
        if not future.lease.release():
            future.cancel()
            return None
        return LayerRead(k, v, place, blocks, future, torch.from_numpy(late))

    def _zero_late(self, k: Tensor, v: Tensor, place: Placed, late: np.ndarray) -> tuple[Tensor, Tensor]:
        """``k`` and ``v`` with the rows of the pages ``late`` [pages] bool says are still loading zeroed."""
        rows = place.at() + np.arange(k.shape[0])[:, None] * k.shape[1]
        rows = rows[late[place.rows() // self.layout.tokens]]
        k, v = k.contiguous(), v.contiguous()                     # fresh: zeroed in place, by row
        for x in (k, v):                  # (index_fill_: 3x slower; a broadcast masked_fill: more)
            put_rows(x.view(-1, x.shape[-1]), rows)
        return k, v

    def _rebuild(self, state: LayerState, place: Placed, blocks: Blocks, shared: bool) -> tuple[Tensor, Tensor]:
        """Keys and values [Hkv, width, D] of the rows ``place`` gives: every row is taken, those of
        no chunk from the first page's first row, for the caller to write over (one indexed copy of
        the whole buffer, none of a part and then another of the whole)."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        plain = self._as_stored(state)                           # a head's keys: its own columns of the factors
        table = blocks.row_table(("factors", D), ("values", None)) if plain else None
        if table is not None:                                     # keys and values by one row index
            rows = torch.from_numpy(place.table_rows(blocks.ids, table.per_block, table.per_token).reshape(-1))
            return tuple(x.index_select(0, rows).view(H, -1, D) for x in table.fields)
        page, tok = place.sources()                                              # [Hkv, width]
        take = blocks.take                   # decodes only these rows when pages are quantized
        if shared and not plain:
            factors = take("factors", (page[0], tok[0]))                       # [width, r]
            k = reconstruct(factors, state.basis.basis, H, exact=state.basis.exact)
            return k.transpose(0, 1).contiguous(), take("values", (page[0], tok[0])).transpose(0, 1).contiguous()
        heads = np.arange(H)[:, None]
        return self._head_keys(state, blocks, page, tok, heads), take("values", (page, tok, heads))

    def _as_stored(self, state: LayerState) -> bool:
        """Whether keys and values are taken as the pages store them: the identity basis (the factors are
        the keys) and no codec."""
        return state.basis.exact and self.layout.codec is None

    def _head_keys(self, state: LayerState, blocks: Blocks, page: Index, tok: Index, heads: Index) -> Tensor:
        """Each KV head's keys of rows (page, tok) of ``blocks`` [Hkv, ...]: with the identity basis the
        factors are the keys, and only the head's own columns are read; otherwise factors @ B_h."""
        if self._as_stored(state):
            return blocks.take("factors", (page, tok, heads), split=self.layout.head_dim)
        factors = blocks.take("factors", (page, tok))                            # [Hkv, ..., r]
        return state.head_keys(factors.flatten(1, -2)).view(*factors.shape[:-1], -1)


def pages_buffer(pages: int, block_bytes: int) -> Tensor:
    """Room for pages copied out of the tiers, uninitialised (rows of pages not copied in yet are masked)."""
    return torch.empty(pages, block_bytes, dtype=torch.uint8)
