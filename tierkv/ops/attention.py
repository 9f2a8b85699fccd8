"""Attention over KV that arrives in blocks, and the exact merge of the partial results.

``attend`` runs one query chunk against one key block and returns the block's softmax-normalised
output together with the log-sum-exp of each query row. ``merge`` combines the partial results
of several key blocks exactly (online softmax)::

    out = sum_i exp(lse_i - lse) * out_i        lse = logsumexp_i(lse_i)

GQA is handled by folding the G query heads of each KV group into the query length, so the kernel
sees ``Hkv`` heads with ``G*Tq`` rows each (on CPU ~2.5x faster than ``enable_gqa=True``)::

    q [B, H, Tq, D] -> [B, Hkv, G*Tq, D]        row g*Tq + t = head (kv*G + g), query t

Causal masking uses positions relative to the start of the key block: key j sits at position j,
query t at ``q_offset + t``, and query t sees key j iff ``j <= q_offset + t``. The query rows fall
into three runs, and only the middle one needs a mask::

    t:  0 .. first-1        first .. full-1         full .. Tq-1
        sees no key         sees keys 0..q_offset+t   sees every key
        (out 0, lse -inf)   (masked kernel call)      (unmasked kernel call)

A query chunk checked against a key block that is its own chunk uses ``q_offset=0``; a block that
starts ``s`` tokens after the query chunk's first token uses ``q_offset=-s``.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

# The CPU flash kernel behind SDPA also returns the log-sum-exp (fp32) that merging needs.
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, q_offset: int = 0,
           mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over one key block: ``(out [B, H, Tq, D] in q.dtype, lse [B, H, Tq] fp32)``.

    ``out`` is normalised within the block; rows that see no key get ``out = 0`` and
    ``lse = -inf`` (they drop out of ``merge``). ``mask`` (not causal): additive, per KV head
    [B or 1, Hkv, 1, Tk], -inf for keys left out; every KV head must keep a key.
    """
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"q has {H} heads, not a multiple of the {Hkv} KV heads")
    if mask is not None:
        if causal:
            raise ValueError("attend: a key mask is for non-causal blocks; causal blocks build their own")
        return _attend_folded(q, k, v, mask.to(q.dtype))
    if causal and q_offset == 0 and Tq == Tk > 1 and _kernel(q, k, v) is _attend_cpu_flash:
        return _attend_square_causal(q, k, v)
    first, full = _row_runs(Tq, Tk, q_offset) if causal else (0, 0)
    if first == 0 and full in (0, Tq):  # one run covers every row: no copies
        mask = _band_mask(0, Tq, Tk, q_offset, H // Hkv, q.dtype, q.device) if full else None
        return _attend_folded(q, k, v, mask)
    out = q.new_zeros(B, H, Tq, D)
    lse = q.new_full((B, H, Tq), -math.inf, dtype=torch.float32)
    if first < full:
        mask = _band_mask(first, full, Tk, q_offset, H // Hkv, q.dtype, q.device)
        out[:, :, first:full], lse[:, :, first:full] = _attend_folded(q[:, :, first:full], k, v, mask)
    if full < Tq:
        out[:, :, full:], lse[:, :, full:] = _attend_folded(q[:, :, full:], k, v, None)
    return out, lse


def merge(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Combine ``[(out, lse), ...]`` of disjoint key blocks into the attention over all of them."""
    return merge_lse(parts)[0]


def merge_lse(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """``merge`` that also returns the combined lse, for running (online) accumulation."""
    if not parts:
        raise ValueError("merge needs at least one (out, lse) part")
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])               # [P, B, H, T]
    lse = torch.logsumexp(lses, dim=0)                          # [B, H, T]; -inf where no key
    weights = torch.exp(lses - lse.nan_to_num(neginf=0.0))      # [P, B, H, T]; 0 for empty rows
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)    # [B, H, T, D]
    for (part, _), w in zip(parts, weights):
        out.addcmul_(part.float(), w.unsqueeze(-1))
    return out.to(parts[0][0].dtype), lse


def block_lse(q: Tensor, k: Tensor, block_tokens: int) -> Tensor:
    """Log-sum-exp of each query row over each key block: q [B, H, Tq, D], k [B, Hkv, n*T, D] -> [B, H, Tq, n]."""
    B, H, Tq, D = q.shape
    Hkv, n = k.shape[1], k.shape[2] // block_tokens
    qf = q.reshape(B, Hkv, (H // Hkv) * Tq, D).float()                 # [B, Hkv, G*Tq, D]
    scores = qf @ k.float().transpose(-1, -2) / math.sqrt(D)           # [B, Hkv, G*Tq, n*T]
    lse = scores.unflatten(-1, (n, block_tokens)).logsumexp(dim=-1)    # [B, Hkv, G*Tq, n]
    return lse.reshape(B, H, Tq, n)                                    # row g*Tq + t -> head kv*G + g


def block_mass(lse_blocks: Tensor, lse: Tensor) -> Tensor:
    """Attention mass each block received, summed over batch, heads and query rows: [n].

    ``lse_blocks`` [B, H, Tq, n] from `block_lse`; ``lse`` [B, H, Tq] over all keys (from `merge_lse`).
    """
    return torch.exp(lse_blocks - lse.unsqueeze(-1)).sum(dim=(0, 1, 2))


def _row_runs(Tq: int, Tk: int, q_offset: int) -> tuple[int, int]:
    """``(first, full)``: rows before ``first`` see no key, rows from ``full`` on see every key."""
    first = min(max(-q_offset, 0), Tq)
    full = min(max(Tk - 1 - q_offset, first), Tq)
    return first, full


def _band_mask(first: int, full: int, Tk: int, q_offset: int, G: int,
               dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [G*Tb, Tk] for query rows first..full-1, repeated for the folded heads."""
    rows = torch.arange(first, full, device=device) + q_offset   # [Tb] query positions
    keys = torch.arange(Tk, device=device)                       # [Tk] key positions
    mask = torch.zeros(full - first, Tk, dtype=dtype, device=device)
    mask.masked_fill_(keys[None, :] > rows[:, None], -math.inf)  # [Tb, Tk]
    return mask.repeat(G, 1)                                     # [G*Tb, Tk]


def _attend_folded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Attention with the query heads folded into the query length; no row may be fully masked."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qf = q.reshape(B, Hkv, (H // Hkv) * T, D)                    # [B, Hkv, G*T, D]
    out, lse = _kernel(qf, k, v)(qf, k, v, mask, 1.0 / math.sqrt(D))
    return out.reshape(B, H, T, D), lse.reshape(B, H, T)   # the flash op's output is strided


def _attend_square_causal(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A chunk attending causally to itself: the kernel's own causal mode skips the blocks above the
    diagonal (half the work, no mask in memory), which needs the KV heads repeated, not folded."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k = k.repeat_interleave(G, dim=1) if G > 1 else k          # [B, H, T, D]
    v = v.repeat_interleave(G, dim=1) if G > 1 else v
    out, lse = _cpu_flash(q, k, v, 0.0, True, scale=1.0 / math.sqrt(D))
    return out, lse


def _kernel(q: Tensor, k: Tensor, v: Tensor) -> Callable[..., tuple[Tensor, Tensor]]:
    """The CPU flash kernel where it applies (~2-3x faster than matmul), else the fp32 fallback."""
    if q.device.type == "cpu" and k.dtype == q.dtype and v.dtype == q.dtype:
        return _attend_cpu_flash
    return _attend_matmul


def _attend_cpu_flash(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                      scale: float) -> tuple[Tensor, Tensor]:
    """q [B, Hkv, R, D], k/v [B, Hkv, Tk, D] -> (out [B, Hkv, R, D], lse [B, Hkv, R] fp32)."""
    return _cpu_flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)


def _attend_matmul(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Portable fallback, scores in fp32; same shapes as ``_attend_cpu_flash``."""
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))   # [B, Hkv, R, Tk]
    if mask is not None:
        scores += mask.float()
    peak = scores.amax(dim=-1, keepdim=True)                                 # [B, Hkv, R, 1]
    probs = torch.exp_(scores.sub_(peak))
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v.float()).div_(total)
    return out.to(q.dtype), (peak + total.log()).squeeze(-1)
