"""The compute of one cell: one decoder layer for one GPU batch of left-padded sequences.

Prompts of a GPU batch are left-padded to one length ``P``, so every row's newest token sits in
the last column and one greedy step appends one column to all rows::

    row 0   .  .  a0 a1 a2 | g0 g1        pad[0] = 2
    row 1   b0 b1 b2 b3 b4 | g0 g1        pad[1] = 0
    column  0  1  2  3  4    5  6         position = column - pad   (row 0's a0 is at position 0)

A query in column ``c`` sees the keys of columns ``pad <= s <= c``. Pad queries see only their
own column (their output is never read: no real query sees a pad key), so no row is fully masked.
Rows are independent, so each row computes what it would compute alone (up to float rounding).

The prefill (step 0) computes no padding at all: each row runs alone over its own columns
``pad .. P-1`` with causal attention (the kernel skips the masked half), exactly the ops a
one-document forward runs; its K/V land in the padded [B, Hkv, P, D] with zeros in the pad
columns (finite: masked keys are multiplied by a zero weight). A padded batch would compute
``B * P`` tokens and the full ``P x P`` attention product instead of ``sum(len)`` and half of
``sum(len^2)``: on documents of 99 to 1642 tokens, two to three times the work.

Attention folds each KV head's ``G`` query heads into the query length (``tierkv.ops.attention``
explains why): ``q [B, H, T, D] -> [B, Hkv, G*T, D]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tierkv.model import arch


@dataclass(slots=True)
class GpuBatch:
    """One GPU batch: its prompts and what changes from step to step."""

    ids: Tensor                          # [B, P] prompt ids, left-padded
    pad: Tensor                          # [B] pad tokens before each prompt
    tokens: list[list[int]] = field(default_factory=list)   # generated ids per row
    h: Tensor | None = None              # [B, T, hidden] residual stream between layers
    cos: Tensor | None = None            # [B, T, D] of the current step
    sin: Tensor | None = None
    mask: Tensor | None = None           # [B, 1, G*T, S] bool, True where a query sees a key

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], pad_id: int) -> GpuBatch:
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        pad = torch.tensor([P - len(p) for p in prompts], dtype=torch.long)
        return cls(ids, pad, [[] for _ in prompts])


def start_step(model: nn.Module, batch: GpuBatch, step: int, group: int) -> None:
    """Embed the step's input (the prompt at step 0, else the last token) and build RoPE and mask."""
    if step == 0:
        ids, start = batch.ids, 0
    else:
        ids = torch.tensor([[row[-1]] for row in batch.tokens], dtype=torch.long)
        start = batch.prompt_len + step - 1
    T = ids.shape[1]
    columns = torch.arange(start, start + T)                                    # [T]
    positions = (columns[None, :] - batch.pad[:, None]).clamp_min(0)            # [B, T]
    batch.cos, batch.sin = arch.rope_cos_sin(model, positions)
    batch.mask = None if step == 0 else keep_mask(batch.pad, start, T).repeat(1, 1, group, 1)  # [B, 1, G*T, S]
    batch.h = arch.embed(model, ids)


def keep_mask(pad: Tensor, start: int, T: int) -> Tensor:
    """[B, 1, T, start+T] bool: query column c sees key column s iff pad <= s <= c (and itself)."""
    keys = torch.arange(start + T)                                               # [S]
    cols = torch.arange(start, start + T)                                        # [T]
    causal = keys[None, :] <= cols[:, None]                                      # [T, S]
    real = keys[None, :] >= pad[:, None]                                         # [B, S]
    own = keys[None, :] == cols[:, None]                                         # [T, S]
    return ((causal[None] & real[:, None, :]) | own[None]).unsqueeze(1)


def layer_forward(layer: nn.Module, batch: GpuBatch, past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Run one decoder layer on ``batch.h``; returns the step's new K, V [B, Hkv, T, D].

    ``past`` is K/V [B, Hkv, S0 + T, D] with room for this step: its last T columns are free and the
    step writes its own K/V there (the loader left the room, so the cell's KV is not copied again);
    None at the prefill."""
    if past is None:
        return prefill_rows(layer, batch)
    h = batch.h
    q, _, k, v = arch.project_qkv(layer, h, batch.cos, batch.sin)              # q [B,H,T,D], k/v [B,Hkv,T,D]
    keys, values = past
    T = k.shape[2]
    keys[:, :, -T:], values[:, :, -T:] = k, v
    out = attend(q, keys, values, batch.mask)
    batch.h = arch.mlp_block(layer, arch.finish_attention(layer, out, h))
    return k, v


SHORT = 64   # tokens under which a layer costs about as much for one row as for several (its weights' reads)


def prefill_groups(lengths: list[int], short: int = SHORT) -> list[list[int]]:
    """Rows the prefill computes together: rows of one length; all rows under ``short`` tokens in one."""
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(lengths):
        groups.setdefault(n if n >= short else 0, []).append(row)
    return [groups[n] for n in sorted(groups, reverse=True)]


def prefill_rows(layer: nn.Module, batch: GpuBatch) -> tuple[Tensor, Tensor]:
    """The prefill of one layer, group by group over each group's own columns; K, V [B, Hkv, P, D].

    A group of one length runs causal over its columns alone; the group of short rows runs padded
    to its longest with the keep-mask. K/V columns no row of a group reaches stay zero.
    """
    h, pad, P = batch.h, batch.pad, batch.prompt_len                           # h [B, P, hidden]
    out, keys, values = torch.zeros_like(h), None, None
    for rows in prefill_groups((P - pad).tolist()):
        start = int(pad[rows].min())
        sub = h[rows, start:]                                                    # [R, P - start, hidden]
        cos, sin = batch.cos[rows, start:], batch.sin[rows, start:]
        padded = None if int(pad[rows].max()) == start else pad[rows] - start
        sub, k, v = prefill_one(layer, sub, cos, sin, padded)
        if keys is None:
            keys = k.new_zeros(h.shape[0], k.shape[1], P, k.shape[3])           # [B, Hkv, P, D]
            values = torch.zeros_like(keys)
        out[rows, start:], keys[rows, :, start:], values[rows, :, start:] = sub, k, v
    batch.h = out
    return keys, values


def prefill_one(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor,
                pad: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Rows h [R, T, hidden] with no earlier keys through one layer -> (h out, K, V [R, Hkv, T, D]).

    Causal when ``pad`` is None (the ops of a one-document forward), else under the keep-mask of
    ``pad`` [R] (left padding within these T columns)."""
    q, _, k, v = arch.project_qkv(layer, h, cos, sin)                          # q [R,H,T,D], k/v [R,Hkv,T,D]
    G = q.shape[1] // k.shape[1]
    if pad is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)
    else:
        out = attend(q, k, v, keep_mask(pad, 0, h.shape[1]).repeat(1, 1, G, 1))
    return arch.mlp_block(layer, arch.finish_attention(layer, out, h)), k, v


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, H, T, D], k/v [B, Hkv, S, D], mask [B, 1, G*T, S] -> out [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qf = q.reshape(B, Hkv, (H // Hkv) * T, D)                                    # [B, Hkv, G*T, D]
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
    return out.reshape(B, H, T, D)


def finish_step(model: nn.Module, batch: GpuBatch) -> list[int]:
    """Greedy next token of every row, from the last column's logits; appended to ``batch.tokens``."""
    logits = arch.final_logits(model, batch.h[:, -1:])                          # [B, 1, vocab]
    nxt = logits[:, 0].argmax(dim=-1).tolist()
    for row, token in zip(batch.tokens, nxt):
        row.append(int(token))
    batch.h = None
    return nxt
