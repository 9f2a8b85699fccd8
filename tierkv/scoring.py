"""Chunk scoring: how much a query may attend to each chunk of stored keys.

The math every chunk selector shares, host-side or near the memory (the CXL
tier's processor runs these same functions, so both pick the same chunks).
A *chunk* is ``chunk_tokens`` consecutive tokens of one layer; per chunk and
KV head the index keeps a summary of its keys (in any dtype; scored in float32)::

    landmarks  [C, Hkv, D]   mean key of the chunk (ShadowKV); or int8 codes with a scale
                             [C, Hkv] per chunk and head (landmark = code * scale)
    lo, hi     [C, Hkv, D]   per-dimension min / max key of the chunk (Quest)

GQA: a KV head serves ``G`` query heads; its score for a chunk is the max
over those heads, so a chunk any head of the group needs ranks high::

    query [Hq, D] -> [Hkv, G, D];  scores [Hkv, C] = max_g  q[h, g] . summary[c, h]

Selection then keeps, per KV head, the ``k`` best chunks among the
candidates, returned in ascending chunk order (= token order). With bf16
landmarks, `top_landmark_chunks` scores every chunk in bf16 first and exactly
only those the rounding could still put in the top ``k`` (the same chunks).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

BLOCK = 8192     # landmarks per KV head widened to float32 at a time (3 heads x 64 dims: 6 MiB)
TWO_PASS_FROM = 6144   # chunks a layer from which bf16 landmarks are scored in two passes (below: one exact pass is faster)


def landmark_scores(query: Tensor, landmarks: Tensor, scale: Tensor | None = None) -> Tensor:
    """query [Hq, D], landmarks [C, Hkv, D] -> [Hkv, C]: max over each group of q . landmark.
    ``scale`` [C, Hkv]: the landmarks are int8 codes; a chunk's scale multiplies its score once
    (it is positive, so it commutes with the max), not each of its D values.

    Landmarks kept in another dtype (bf16, int8) are widened to float32 ``BLOCK`` rows at a time,
    into one buffer that stays in cache: widening all of them at once wrote a float32 copy of the
    whole index at every selection (3 GB a token at 1M tokens; ~40 ms a layer against 7 ms on 2 cores)."""
    C, Hkv, D = landmarks.shape
    q = query.reshape(Hkv, -1, D).float()                          # [Hkv, G, D]
    per_head = landmarks.permute(1, 0, 2)                          # [Hkv, C, D]: no copy when stored head-major
    scores = torch.empty(Hkv, C, dtype=torch.float32, device=landmarks.device)
    if per_head.dtype == torch.float32:
        torch.amax(torch.bmm(q, per_head.transpose(1, 2)), dim=1, out=scores)     # [Hkv, G, C] -> [Hkv, C]
    elif C:
        block = torch.empty(Hkv, min(C, BLOCK), D, dtype=torch.float32, device=landmarks.device)
        for start in range(0, C, BLOCK):
            rows = block[:, :min(BLOCK, C - start)].copy_(per_head[:, start:start + BLOCK])
            torch.amax(torch.bmm(q, rows.transpose(1, 2)), dim=1, out=scores[:, start:start + rows.shape[1]])
    return scores if scale is None else scores.mul_(scale.T.float())


def top_landmark_chunks(query: Tensor, landmarks: Tensor, k: int, candidates: Tensor | None = None, *,
                        scale: Tensor | None = None, norm: Tensor | None = None) -> Tensor:
    """``top_chunks(landmark_scores(query, landmarks, scale), k, candidates)``: the same chunks (up to
    float32 ties), found without widening every bf16 landmark to float32.

    ``norm`` [Hkv]: a bound on every landmark's L2 norm, per KV head (``ChunkIndex.landmark_norm``).
    Given it, and bf16 landmarks, every chunk is first scored in bf16 (the query split into a bf16
    head and tail, so that only the product's rounding to bf16 is lost: at most 2^-8 of the score,
    plus float32 summation error, which the norm bounds); a chunk that could still be among the
    ``k`` best under that error is scored again exactly, and the ``k`` best of those are kept. At 1M
    tokens (131K chunks a layer) that reads the landmarks once in bf16, in about half the time of
    float32 widening on two cores, and rescores a few hundred to a few thousand chunks a head.
    Anything else (float32 or int8 landmarks, no norm, fewer than ``TWO_PASS_FROM`` chunks: a 32K
    context's 4K chunks score exactly in 0.63 ms against 0.79 in two passes) scores exactly."""
    C, Hkv, D = landmarks.shape
    if scores_every_chunk(landmarks, k, scale=scale, norm=norm):
        return top_chunks(landmark_scores(query, landmarks, scale), k, candidates)
    per_head = landmarks.permute(1, 0, 2)                                  # [Hkv, C, D]
    q = query.reshape(Hkv, -1, D).float()                                  # [Hkv, G, D]
    G = q.shape[1]
    head = q.bfloat16()
    tail = q - head.float()
    split = bool(tail.any())
    rows = torch.cat([head, tail.bfloat16()], 1) if split else head
    rough = torch.empty(Hkv, C, rows.shape[1], dtype=torch.bfloat16)
    for h in range(Hkv):    # a product a head (batched over landmarks narrowed out of their storage: 20x slower);
        torch.mm(per_head[h], rows[h].T, out=rough[h])   # landmarks x rows^T: twice rows x landmarks^T's speed
    wide = rough.float()                                                   # [Hkv, C, rows]

    def row(g: int) -> Tensor:                           # query row g's scores, its bf16 head's and tail's summed
        return wide[..., g] + wide[..., G + g] if split else wide[..., g]
    # the max over the group, a column at a time (amax over the last dimension: 2x slower)
    scores = torch.maximum(row(0), row(1)) if G > 1 else row(0).clone()
    for g in range(2, G):
        torch.maximum(scores, row(g), out=scores)                          # [Hkv, C]
    # |scores - exact| <= u |scores| + c (see the docstring); exact: float32 products summed in any order
    u = 2.0 ** -8 * 1.02
    residual = (tail - tail.bfloat16().float()).norm(dim=-1) if split else torch.zeros(Hkv, G)
    summed = 3 * D * 2.0 ** -24 * q.norm(dim=-1)                           # this pass's, the rescoring's, slack
    c = ((summed + residual + 2 * u * tail.norm(dim=-1)).amax(dim=1) * norm.float() * 1.05).unsqueeze(1)
    rough_scores = scores.numpy()            # masked and compared by numpy: torch's masked_fill_ and >= over
    if candidates is not None:               # [3, 131K] took 0.44 and 0.31 ms here, numpy 0.14 and 0.03
        np.copyto(rough_scores, -np.inf, where=~candidates.cpu().numpy())
        k = min(k, int(candidates.sum()))
    k = min(k, C)
    if k == 0:
        return torch.empty(Hkv, 0, dtype=torch.long)
    kth = torch.from_numpy(np.partition(rough_scores, C - k, axis=1)[:, C - k:C - k + 1].copy())   # [Hkv, 1]
    low = kth - u * kth.abs() - c            # at least k chunks score this much or more, exactly
    above = low - c                          # a chunk whose rough score + its error reaches ``low``:
    floor = torch.where(above >= 0, above / (1 + u), above / (1 - u))            # rough >= floor
    kept = rough_scores >= floor.numpy()                                   # [Hkv, C]: at least k a head
    best = []
    for h in range(Hkv):
        ids = torch.from_numpy(np.flatnonzero(kept[h]))                    # numpy's: 5x torch.nonzero's speed
        exact = (q[h] @ per_head[h].index_select(0, ids).float().T).amax(dim=0)   # [m]
        best.append(ids[exact.topk(k, sorted=False).indices])
    return torch.stack(best).sort(dim=1).values


def chunk_rows(summary: Tensor, chunks: Tensor) -> Tensor:
    """``summary[chunks]`` of a chunk summary [C, Hkv, D] (landmarks, lo, hi), as [n, Hkv, D] over rows
    stored head-major, as the index keeps them: gathered a head at a time, 2.6x the speed of indexing
    the permuted view (154 against 407 us for 2,260 of 131K bf16 landmarks; ``index_select`` along
    the chunks of the whole [Hkv, C, D] view, not contiguous, took 19 ms)."""
    per_head = summary.permute(1, 0, 2)
    return torch.stack([rows.index_select(0, chunks) for rows in per_head]).permute(1, 0, 2)


def scores_every_chunk(landmarks: Tensor, k: int, *, scale: Tensor | None = None,
                       norm: Tensor | None = None) -> bool:
    """Whether `top_landmark_chunks` scores every chunk exactly (``landmark_scores``), not in two passes."""
    return norm is None or scale is not None or landmarks.dtype != torch.bfloat16 \
        or landmarks.device.type != "cpu" or landmarks.shape[0] < TWO_PASS_FROM or k <= 0


def longest_landmark(landmarks: Tensor) -> Tensor:
    """[C, Hkv, D] -> [Hkv]: each head's longest landmark (L2, float32; 0 where there is none), widened
    ``BLOCK`` rows at a time (6 ms a layer of 131K bf16 landmarks, against 31 in one pass)."""
    C, Hkv, D = landmarks.shape
    longest = torch.zeros(Hkv, device=landmarks.device)
    per_head = landmarks.permute(1, 0, 2)
    block = torch.empty(Hkv, min(C, BLOCK), D, device=landmarks.device)
    for start in range(0, C, BLOCK):
        rows = block[:, :min(BLOCK, C - start)].copy_(per_head[:, start:start + BLOCK])
        torch.maximum(longest, rows.mul_(rows).sum(dim=-1).amax(dim=1), out=longest)
    return longest.sqrt_()


def landmark_values(landmarks: Tensor, scale: Tensor | None) -> Tensor:
    """Landmarks [C, Hkv, D] as float32 values (decoded when they are int8 codes with ``scale`` [C, Hkv])."""
    return landmarks.float() if scale is None else landmarks.float() * scale.float().unsqueeze(-1)


def quantize_landmarks(means: Tensor) -> tuple[Tensor, Tensor]:
    """means [n, Hkv, D] -> int8 codes [n, Hkv, D] and float16 scales [n, Hkv]: symmetric, one scale
    per chunk and head (rounded up, so no code leaves -127..127)."""
    peak = means.abs().amax(dim=-1).float() / 127                 # [n, Hkv]
    scale = peak.half()
    scale = torch.where(scale.float() < peak, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny)
    codes = (means.float() / scale.float().unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scale


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
    return top_indices(scores, min(k, scores.shape[1]))


def top_indices(scores: Tensor, k: int) -> Tensor:
    """The indices [H, k] of each row's ``k`` largest of ``scores`` [H, n], ascending (0 <= k <= n; among
    equal scores at the cut, any). On the CPU by numpy's introselect (``argpartition``) and a sort of the
    k indices: 39 us for 512 of 4K chunks of 3 heads, where ``topk`` and the same sort took 129."""
    H, n = scores.shape
    if k == 0:
        return torch.empty(H, 0, dtype=torch.long, device=scores.device)
    if scores.device.type != "cpu" or scores.dtype not in _NUMPY_SCORES:
        return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    if k == n:
        return torch.arange(n).repeat(H, 1)
    return torch.from_numpy(np.sort(np.argpartition(scores.numpy(), n - k, axis=1)[:, n - k:], axis=1))


_NUMPY_SCORES = (torch.float32, torch.float64)
