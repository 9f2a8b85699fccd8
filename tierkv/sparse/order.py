"""Where each gathered token goes in a layer's context. The chunks read and the outliers come as two
ascending runs of chunk ids per KV head; they merge by a binary search at chunk granularity (a few
hundred ids, not thousands of tokens), and every token is then taken straight into its row of the
context buffer, with no sort and no second copy (``tierkv.sparse.sequence`` gathers; compact
positions need the keys in token order)::

    chunks    3 9 12 | outliers 5        slots: chunks 0 2 3, outlier 1
    chunk i   -> i + (outliers before it)             outlier j -> j + (chunks before it)
    token t of the chunk in slot s -> row s*c + t

``Placed`` holds a read's placement: each chunk's page among those read and its slot, from which
every row of the context gets its source (page, row in page), laid out a slot at a time.

This is index bookkeeping on a few thousand integers a layer, done in numpy: a call costs about a
microsecond there, several in PyTorch's dispatch, and a decode step makes hundreds of them.
"""
from __future__ import annotations

import numpy as np


def ascending(chunks: np.ndarray) -> np.ndarray:
    """``chunks`` [H, k] with each row in ascending order (sorted where one is not)."""
    if chunks.shape[1] > 1 and not (chunks[:, 1:] > chunks[:, :-1]).all():
        return np.sort(chunks, axis=1)
    return chunks


def merge_slots(chunks: np.ndarray, outliers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The slots of ``chunks`` [H, k] (ascending and distinct in each row) and of ``outliers`` [m]
    (ascending, none among the chunks) in each row's merged order: ([H, k], [H, m])."""
    k, m = chunks.shape[1], len(outliers)
    before = np.array([np.searchsorted(row, outliers) for row in chunks], dtype=np.int64).reshape(len(chunks), m)
    return np.arange(k) + np.searchsorted(outliers, chunks), np.arange(m) + before


def token_rows(slots: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """Chunk slots [H, k] -> the rows of their tokens [H, k*c]."""
    return (slots[..., None] * chunk_tokens + np.arange(chunk_tokens)).reshape(len(slots), -1)


def page_set(pages: np.ndarray) -> np.ndarray:
    """Page ids [H, k] -> the pages, ascending, each once: ``np.unique`` by a mark per page."""
    return np.flatnonzero(_marks(pages))


def page_slots(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Page ids [H, k] -> the pages (ascending, each once) and each id's place among them: what
    ``np.unique(..., return_inverse=True)`` gives, by a mark per page rather than a sort."""
    marked = _marks(pages)
    return np.flatnonzero(marked), (np.cumsum(marked) - 1)[pages]


def _marks(pages: np.ndarray) -> np.ndarray:
    marked = np.zeros(int(pages.max()) + 1 if pages.size else 0, dtype=bool)
    marked[pages] = True
    return marked


class Placed:
    """Where a read's chunks lie and where their tokens go: ``chunks`` [Hkv, k], each one's ``page``
    among the pages read [Hkv, k] and its ``slot`` among the ``span`` = (first row, rows) of K and V
    [Hkv, width, D] that chunks and outliers fill, c rows a slot (numpy arrays)."""

    __slots__ = ("chunks", "page", "slot", "span", "width", "c", "P")

    def __init__(self, chunks: np.ndarray, page: np.ndarray, slot: np.ndarray, span: tuple[int, int], width: int,
                 chunk_tokens: int, page_tokens: int) -> None:
        self.chunks, self.page, self.slot, self.span, self.width = chunks, page, slot, span, width
        self.c, self.P = chunk_tokens, page_tokens

    def sources(self) -> tuple[np.ndarray, np.ndarray]:
        """The page among those read and the row in it of every row of K and V [Hkv, width] (0, 0 for
        rows of no chunk), laid out a slot at a time and repeated over its c rows."""
        H, (first, rows), c = len(self.chunks), self.span, self.c
        heads, page, tok = np.arange(H)[:, None], np.zeros((H, rows // c), np.int64), np.zeros((H, rows // c), np.int64)
        page[heads, self.slot], tok[heads, self.slot] = self.page, self.chunks % (self.P // c) * c
        page_of, tok_of = np.zeros((H, self.width), np.int64), np.zeros((H, self.width), np.int64)
        page_of[:, first:first + rows] = np.repeat(page, c, axis=1)
        tok_of[:, first:first + rows] = (tok[..., None] + np.arange(c)).reshape(H, rows)
        return page_of, tok_of

    def table_rows(self, ids: np.ndarray, per_block: int, per_token: int) -> np.ndarray:
        """`sources` as rows of one table of the pages' rows [Hkv, width] (`tierkv.layout.RowTable`:
        token t of head h of the page read j, the ``ids[j]``-th block of the buffer, is row
        ``ids[j] * per_block + t * per_token + h``), worked out a chunk at a time and then spread over
        its c tokens; rows of no chunk are the first page's first token."""
        H, (first, rows), c = len(self.chunks), self.span, self.c
        heads = np.arange(H)[:, None]
        spare = int(ids[0]) * per_block + heads                                       # [Hkv, 1]
        chunk = ids[self.page] * per_block + self.chunks % (self.P // c) * (c * per_token) + heads
        slot = np.repeat(spare, rows // c, axis=1)
        slot[heads, self.slot] = chunk
        out = np.empty((H, self.width), np.int64)
        out[:, :first], out[:, first + rows:] = spare, spare
        out[:, first:first + rows] = (slot[..., None] + np.arange(c) * per_token).reshape(H, rows)
        return out

    def rows(self) -> np.ndarray:
        """Each chunk token's row in the pages read, page * P + row in page [Hkv, k*c]."""
        return np.repeat(self.page, self.c, axis=1) * self.P + token_rows(self.chunks % (self.P // self.c), self.c)

    def at(self) -> np.ndarray:
        """Each chunk token's row of K and V [Hkv, k*c]."""
        return self.span[0] + token_rows(self.slot, self.c)
