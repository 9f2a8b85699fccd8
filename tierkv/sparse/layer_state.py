"""One layer's state under sparse attention, and how a branch of it shares the parent's.

A fork (``LayerState.fork``) is a new branch of the same tokens: what only grows or
never changes after the key basis is fitted is shared, what a branch changes in place is
its own::

    shared       sinks, basis (once fitted), page keys so far, the index's summaries
                 (copied when the branch first extends them: ChunkIndex.fork)
    own copy     window (a FIFO the next tokens push into), Gram matrix (before the fit),
                 outlier set, page key list (the new pages are the branch's)

A crop takes back the newest tokens, which the window still holds.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout
from tierkv.sparse.config import SparseConfig
from tierkv.sparse.index import ChunkIndex
from tierkv.sparse.lowrank import KeyBasis


class _Fifo:
    """Rows [t, Hkv, D] appended at the back, taken from the front."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.data = torch.empty(1024, *shape, dtype=dtype)
        self.head = self.tail = 0

    def __len__(self) -> int:
        return self.tail - self.head

    def push(self, rows: Tensor) -> None:
        if self.tail + rows.shape[0] > self.data.shape[0]:
            live = self.data[self.head:self.tail]
            size = max(self.data.shape[0], 2 * (len(self) + rows.shape[0]))
            self.data = torch.cat([live, torch.empty(size - len(live), *self.data.shape[1:],
                                                     dtype=self.data.dtype)])
            self.head, self.tail = 0, len(live)
        self.data[self.tail:self.tail + rows.shape[0]] = rows
        self.tail += rows.shape[0]

    def pop(self, n: int) -> Tensor:
        rows = self.data[self.head:self.head + n].clone()
        self.head += n
        if self.head > self.data.shape[0] // 2:   # give back what the taken front held
            live = self.data[self.head:self.tail]
            self.data = torch.cat([live, torch.empty(max(1024, len(live)), *self.data.shape[1:],
                                                     dtype=self.data.dtype)])
            self.head, self.tail = 0, len(live)
        return rows

    def rows(self) -> Tensor:
        return self.data[self.head:self.tail]

    def drop_last(self, n: int) -> None:
        self.tail -= n

    def copy(self) -> _Fifo:
        twin = _Fifo(tuple(self.data.shape[1:]), self.data.dtype)
        twin.push(self.rows())
        return twin


class LayerState:
    """One layer of a sparse sequence: sinks, window, key basis, chunk index and page keys."""

    def __init__(self, layer: int, config: SparseConfig, layout: BlockLayout, needs: frozenset[str],
                 dtype: torch.dtype) -> None:
        H, D = layout.num_kv_heads, layout.head_dim
        self.sink_k, self.sink_v = torch.empty(0, H, D, dtype=dtype), torch.empty(0, H, D, dtype=dtype)
        self.win_k, self.win_v = _Fifo((H, D), dtype), _Fifo((H, D), dtype)
        self.basis = KeyBasis(H * D)
        # summaries in the pages' dtype (landmarks of 1M tokens: 1.5 GiB in bf16) or int8, scored in float32
        self.index = ChunkIndex(layer, H, D, chunk_tokens=config.chunk_tokens, needs=needs, dtype=layout.dtype,
                                int8_landmarks=config.int8_landmarks)
        self.pages: list[BlockKey] = []
        self.page_rows = np.empty(0, dtype=np.int64)        # each page's directory row, as reads found it
        self.previous = np.empty(0, dtype=np.int64)         # pages read by the last step
        self.length = 0
        self._head_basis: Tensor | None = None

    def row_hints(self, pages: np.ndarray, find: Callable[[list[BlockKey]], np.ndarray]) -> np.ndarray:
        """The directory rows of ``pages``: guesses the manager checks against the keys before it takes
        them (`BlockingTierManager.read`'s ``rows``). Pages new since the last call are found at once
        (``find``: keys -> rows); each read then keeps the rows it found."""
        if len(self.page_rows) < len(self.pages):
            self.page_rows = np.concatenate([self.page_rows, find(self.pages[len(self.page_rows):])])
        return self.page_rows[pages]

    def head_keys(self, factors: Tensor) -> Tensor:
        """Keys [Hkv, m, D] of each head's own rows of factors [Hkv, m, r]: ``factors[h] @ B_h``, or at
        full rank (the identity basis) head h's own columns, with no product."""
        if not self.basis.exact:
            return torch.bmm(factors.float(), self.head_basis())
        H, m = factors.shape[0], factors.shape[1]
        heads = torch.arange(H)
        return factors.view(H, m, H, -1)[heads, :, heads]

    def head_basis(self) -> Tensor:
        """The basis split per KV head: [Hkv, r, D] (keys of head h = A @ B[:, h*D:(h+1)*D])."""
        if self._head_basis is None:
            basis = self.basis.basis                                   # [r, Hkv*D]
            heads = self.sink_k.shape[1]
            self._head_basis = basis.view(basis.shape[0], heads, -1).transpose(0, 1).contiguous()
        return self._head_basis

    def crop(self, tokens: int) -> None:
        """Forget the newest ``tokens`` tokens. They are still in the window (it keeps at least
        ``window_tokens``, and sealing takes pages from its other end), so nothing sealed changes;
        before the key basis is fitted their keys leave the Gram matrix too."""
        if tokens > len(self.win_k):
            raise ValueError(f"crop: {tokens} tokens, but only the newest {len(self.win_k)} (the window) can go")
        if self.basis.basis is None and tokens:
            gone = self.win_k.rows()[len(self.win_k) - tokens:]
            self.basis.add(gone, sign=-1.0)
        self.win_k.drop_last(tokens)
        self.win_v.drop_last(tokens)
        self.length -= tokens

    def fork(self) -> LayerState:
        """A branch of this layer (see the module notes)."""
        twin = object.__new__(LayerState)
        twin.sink_k, twin.sink_v = self.sink_k, self.sink_v
        twin.win_k, twin.win_v = self.win_k.copy(), self.win_v.copy()
        twin.basis = self.basis if self.basis.basis is not None else self.basis.copy()
        twin.index = self.index.fork()
        twin.pages, twin.page_rows = list(self.pages), self.page_rows.copy()
        twin.previous, twin.length, twin._head_basis = self.previous, self.length, self._head_basis
        return twin


