"""Comparing two runs' logits over the same steps (bench/accuracy.py, bench/quant_rows.py)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def top1(logits: Tensor, ref: Tensor) -> float:
    """Share of steps whose argmax matches: ``ref`` is logits [S, V] or tokens [S]."""
    ref = ref.argmax(-1) if ref.dim() == 2 else ref
    return round(float((logits.argmax(-1) == ref).float().mean()), 4)


def kl(p_logits: Tensor, q_logits: Tensor) -> float:
    """Mean KL(p || q) per step, nats."""
    p, q = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return round(float((p.exp() * (p - q)).sum(-1).mean()), 5)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)
