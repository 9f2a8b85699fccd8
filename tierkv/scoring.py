"""Chunk scoring: how much a query may attend to each chunk of stored keys.

The math every chunk selector shares, host-side or near the memory (the CXL
tier's processor runs these same functions, so both pick the same chunks).
A *chunk* is ``chunk_tokens`` consecutive tokens of one layer; per chunk and
KV head the index keeps a summary of its keys (in any dtype; scored in float32)::

    landmarks  [C, Hkv, D]   mean key of the chunk (ShadowKV)
    lo, hi     [C, Hkv, D]   per-dimension min / max key of the chunk (Quest)

GQA: a KV head serves ``G`` query heads; its score for a chunk is the max
over those heads, so a chunk any head of the group needs ranks high::

    query [Hq, D] -> [Hkv, G, D];  scores [Hkv, C] = max_g  q[h, g] . summary[c, h]

Selection then keeps, per KV head, the ``k`` best chunks among the
candidates, returned in ascending chunk order (= token order).
"""
from __future__ import annotations

import torch
from torch import Tensor


def landmark_scores(query: Tensor, landmarks: Tensor) -> Tensor:
    """query [Hq, D], landmarks [C, Hkv, D] -> [Hkv, C]: max over each group of q . landmark."""
    C, Hkv, D = landmarks.shape
    q = query.reshape(Hkv, -1, D).float()                          # [Hkv, G, D]
    per_head = landmarks.permute(1, 0, 2).float()                  # [Hkv, C, D]: no copy when stored head-major
    return torch.bmm(q, per_head.transpose(1, 2)).amax(dim=1)      # [Hkv, G, C] -> [Hkv, C]


def bound_scores(query: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Quest's upper bound on q . k over each chunk: sum_d max(q_d lo_d, q_d hi_d), max over the group.

    Never below the best real q . k of a key inside [lo, hi] (each term bounds its own product).
    """
    C, Hkv, D = lo.shape
    q = query.reshape(Hkv, -1, 1, D).float()                       # [Hkv, G, 1, D]
    lo_t, hi_t = (x.float().permute(1, 0, 2).unsqueeze(1) for x in (lo, hi))   # [Hkv, 1, C, D]
    bound = torch.maximum(q * lo_t, q * hi_t).sum(dim=-1)          # [Hkv, G, C]
    return bound.amax(dim=1)


def top_chunks(scores: Tensor, k: int, candidates: Tensor | None = None) -> Tensor:
    """scores [Hkv, C] -> chunk indices [Hkv, k'] in ascending order, k' = min(k, candidates).

    ``candidates`` [C] bool: chunks that may be chosen (False: kept exact elsewhere, never picked).
    """
    if k < 0:
        raise ValueError(f"k={k}: must be >= 0")
    if candidates is not None:
        scores = scores.masked_fill(~candidates.to(scores.device), float("-inf"))
        k = min(k, int(candidates.sum()))
    k = min(k, scores.shape[1])
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long)
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
