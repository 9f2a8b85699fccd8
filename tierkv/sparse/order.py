"""Gathered context rows put in token order: a layer's chunk tokens and its outliers come as two
ascending runs of positions per KV head, merged rather than sorted, and moved per head in one
index_select (``tierkv.sparse.sequence`` gathers; compact positions need the keys in token order).
"""
from __future__ import annotations

import torch
from torch import Tensor


def token_order(parts: list[Tensor]) -> Tensor | None:
    """The order [H, n] that puts the positions of ``parts`` ([H, n_i] each, laid end to end; distinct
    in a row) in ascending order row by row; None where they are in order already. The chunks read
    and the outliers come as two ascending parts: they merge by a binary search of the few outliers
    among the chunks' tokens (~0.1 ms for 8.7K tokens of 3 heads, where sorting them all took 0.3-0.4)::

        chunks    10 11 12 | 40 41 42        outliers  20 21       ins = [3, 3]: chunk tokens before each
        order     0 1 2 6 7 3 4 5            chunk token i goes to i + (outliers before it), outlier j to j + ins[j]
    """
    if all(_ascending(p) for p in parts) and len(parts) <= 2:
        if len(parts) == 1 or not parts[1].shape[1]:
            return None
        a, b = parts[0].contiguous(), parts[1].contiguous()
        (H, M), m = a.shape, b.shape[1]
        ins = torch.searchsorted(a, b)                                          # [H, m]
        before = torch.zeros(H, M + 1, dtype=torch.long).scatter_add_(1, ins, torch.ones_like(ins)).cumsum_(1)
        order = torch.empty(H, M + m, dtype=torch.long)
        order.scatter_(1, before[:, :M] + torch.arange(M), torch.arange(M).expand(H, M))
        order.scatter_(1, ins + torch.arange(m), torch.arange(M, M + m).expand(H, m))
        return order
    return torch.cat(parts, 1).argsort(dim=1)


def _ascending(positions: Tensor) -> bool:
    return positions.shape[1] < 2 or bool((positions[:, 1:] > positions[:, :-1]).all())


def per_head(x: Tensor, order: Tensor) -> Tensor:
    """``x[h, order[h]]`` for every head h (x [H, M, ...], order [H, M]): one index_select over the heads'
    rows laid end to end, 4-6x faster than advanced indexing with a head index."""
    H, M = order.shape
    flat = (order + torch.arange(H).unsqueeze(1) * x.shape[1]).reshape(-1)
    return x.reshape(H * x.shape[1], *x.shape[2:]).index_select(0, flat).view(H, M, *x.shape[2:])
