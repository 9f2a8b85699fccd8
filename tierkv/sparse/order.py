"""Where each gathered token goes in a layer's context. The chunks read and the outliers come as two
ascending runs of chunk ids per KV head; they merge by a binary search at chunk granularity (a few
hundred ids, not thousands of tokens), and every token is then taken straight into its row of the
context buffer, with no sort and no second copy (``tierkv.sparse.sequence`` gathers; compact
positions need the keys in token order)::

    chunks    3 9 12 | outliers 5        slots: chunks 0 2 3, outlier 1
    chunk i   -> i + (outliers before it)             outlier j -> j + (chunks before it)
    token t of the chunk in slot s -> row s*c + t
"""
from __future__ import annotations

import torch
from torch import Tensor


def ascending(chunks: Tensor) -> Tensor:
    """``chunks`` [H, k] with each row in ascending order (sorted where one is not)."""
    if chunks.shape[1] > 1 and not bool((chunks[:, 1:] > chunks[:, :-1]).all()):
        return chunks.sort(dim=1).values
    return chunks


def merge_slots(chunks: Tensor, outliers: Tensor) -> tuple[Tensor, Tensor]:
    """The slots of ``chunks`` [H, k] (ascending and distinct in each row) and of ``outliers`` [m]
    (ascending, none among the chunks) in each row's merged order: ([H, k], [H, m])."""
    (H, k), m, chunks = chunks.shape, outliers.numel(), chunks.contiguous()
    return (torch.arange(k) + torch.searchsorted(outliers, chunks),
            torch.arange(m) + torch.searchsorted(chunks, outliers.expand(H, m).contiguous()))


def token_rows(slots: Tensor, chunk_tokens: int) -> Tensor:
    """Chunk slots [H, k] -> the rows of their tokens [H, k*c]."""
    return (slots.unsqueeze(-1) * chunk_tokens + torch.arange(chunk_tokens)).flatten(1)
