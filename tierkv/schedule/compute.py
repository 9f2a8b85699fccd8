"""The compute of one cell: one decoder layer for one GPU batch of left-padded sequences.

Prompts of a GPU batch are left-padded to one length ``P``, so every row's newest token sits in
the last column and one greedy step appends one column to all rows::

    row 0   .  .  a0 a1 a2 | g0 g1        pad[0] = 2
    row 1   b0 b1 b2 b3 b4 | g0 g1        pad[1] = 0
    column  0  1  2  3  4    5  6         position = column - pad   (row 0's a0 is at position 0)

A query in column ``c`` sees the keys of columns ``pad <= s <= c``. Pad queries see only their
own column (their output is never read: no real query sees a pad key), so no row is fully masked.
Rows are independent, so each row computes what it would compute alone (up to float rounding).

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
    batch.mask = keep_mask(batch.pad, start, T).repeat(1, 1, group, 1)           # [B, 1, G*T, S]
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
    """Run one decoder layer on ``batch.h`` over ``past`` K/V [B, Hkv, S0, D]; returns the step's new K, V."""
    h = batch.h
    q, _, k, v = arch.project_qkv(layer, h, batch.cos, batch.sin)              # q [B,H,T,D], k/v [B,Hkv,T,D]
    keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
    out = attend(q, keys, values, batch.mask)
    batch.h = arch.mlp_block(layer, arch.finish_attention(layer, out, h))
    return k, v


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
