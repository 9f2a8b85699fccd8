"""One layer's sparse attention: what it attends besides the new tokens, and the attention itself.

Per layer and forward pass, after the chunks are chosen (``tierkv.sparse.plan``)::

    context  = sinks | pages of the chunks (keys = A B) + outliers | window     pre-RoPE, token order
    RoPE     at the real positions, or compact ones 0 .. |context|-1 then the queries
    out      = merge(attend(q, context), attend(q, new tokens, causal))
               attend(q, context | new token)           decode: one token, in the context's pass

``gather_context`` reads the pages through the sequence; ``attend_layer``
is a pure function of its inputs. With a split read (overlap), the tokens of
pages still loading are masked out of the first pass and attended once they
arrive; the parts merge exactly (log-sum-exp), and each token keeps its
position either way::

    pass 1   sinks | chunks in place + outliers | window     while the rest load
    pass 2   chunks of the pages that arrived               (per KV head: their counts differ)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from tierkv.ops.attention import attend, merge
from tierkv.ops.rope import RopeTable
from tierkv.sparse.plan import Positions
from tierkv.sparse.reads import Loading
from tierkv.sparse.sequence import SparseSequence, joinable


@dataclass(slots=True)
class Context:
    """What a layer attends to besides the new tokens: pre-RoPE K, V [Hkv, Tc, D] and real positions
    [Hkv, Tc] of sinks | gathered chunks + outliers | window (| the decoded token, when ``new``). With
    ``loading``, the gathered rows (``first`` on, real positions ``p_mid`` [Hkv, M]) of pages still
    loading are zeros in ``k``, ``v``."""
    k: Tensor
    v: Tensor
    p: Tensor
    loading: Loading | None = None
    first: int = 0
    p_mid: Tensor | None = None
    new: int = 0            # the last ``new`` rows are the step's own token (decode: one pass, no merge)

    def mask(self) -> Tensor | None:
        """-inf for the tokens still loading, per KV head [1, Hkv, 1, Tc] (None: nothing is)."""
        if self.loading is None:
            return None
        H, Tc = self.p.shape
        mask = torch.zeros(H, Tc)
        mask[:, self.first:self.first + self.p_mid.shape[1]].masked_fill_(self.loading.missing, -math.inf)
        return mask.view(1, H, 1, Tc)

    def abandon(self) -> None:
        """An error before the late pages were attended: they are released when they arrive."""
        if self.loading is not None:
            self.loading.abandon()


def gather_context(seq: SparseSequence, layer: int, chunks: Tensor, *, shared: bool = False,
                   split: bool = False, new: tuple[Tensor, Tensor, int] | None = None) -> Context:
    """Sinks | ``chunks`` [Hkv, k] + outliers | window of ``layer`` (``shared``: every head has the
    same chunks; ``split``: pages not in place are still loading when this returns). ``new``: a decode
    step's own token, (pre-RoPE key, value [Hkv, 1, D], position), joined after the window so that
    ``attend_layer`` attends to everything in one pass. The sequence takes the gathered rows straight
    into a buffer with room for the rest, written here: nothing is copied twice."""
    H = seq.layout.num_kv_heads
    sink_k, sink_v = seq.sinks(layer)
    win_k, win_v = seq.window(layer)
    S, W, n = sink_k.shape[0], win_k.shape[0], 0 if new is None else new[0].shape[1]
    margins = (S, W + n)                # the sequence gathers into the rows between these
    k, v, p_mid, loading = seq.gather_split(layer, chunks, shared=shared, margins=margins) if split else \
        (*seq.gather(layer, chunks, shared=shared, margins=margins), None)
    M = p_mid.shape[1]
    try:
        if loading is not None and not (S or W):
            at, valid, k_new, v_new = loading.finish()      # nothing to attend meanwhile: a head could
            heads = torch.arange(H).unsqueeze(1).expand_as(at)   # be left with no key at all
            k[heads[valid], at[valid]] = k_new[valid].to(k.dtype)   # (joined with float32 outliers,
            v[heads[valid], at[valid]] = v_new[valid].to(v.dtype)   # bf16 page rows were widened)
            loading = None
        start = seq.length(layer) - W
        k_own, v_own, own_pos = new if new is not None else (k[:, :0], v[:, :0], 0)
        k, v = joinable(k, sink_k, win_k, k_own), joinable(v, sink_v, win_v, v_own)
        for x, sinks, window, own in ((k, sink_k, win_k, k_own), (v, sink_v, win_v, v_own)):
            x[:, :S], x[:, S + M:S + M + W], x[:, S + M + W:] = sinks.transpose(0, 1), window.transpose(0, 1), own
        p = torch.cat([torch.arange(S).expand(H, -1), p_mid, torch.arange(start, start + W).expand(H, -1),
                       torch.arange(own_pos, own_pos + n).expand(H, -1)], dim=1)
    except BaseException:
        if loading is not None:     # its pages are let go of as they arrive
            loading.abandon()
        raise
    return Context(k, v, p, loading, S, p_mid, n)


def attend_layer(q_pre: Tensor, k_pre: Tensor, v: Tensor, pos: int, context: Context, positions: Positions,
                 rope: RopeTable) -> Tensor:
    """Attention output [1, H, T, D] of the new tokens (q_pre [1, H, T, D], k_pre and v [1, Hkv, T, D],
    the first at position ``pos``) over ``context`` and, causally, over themselves."""
    Tc = context.k.shape[1] - context.new
    start = positions.query_start(Tc, pos)
    q = positions.rotate_new(q_pre, start)
    parts = []
    if not context.new:         # the new tokens on their own, causally (the context holds the decoded one)
        parts.append(attend(q, positions.rotate_new(k_pre, start), v, causal=True))
    if Tc or context.new:
        k_ctx = positions.context_keys(context.k, context.p).to(q.dtype)
        parts.append(attend(q, k_ctx, context.v.to(q.dtype).unsqueeze(0), causal=False, mask=context.mask()))
    if context.loading is not None:
        parts.append(_arrived(q, context, positions, rope))
    return merge(parts)


def _arrived(q: Tensor, context: Context, positions: Positions, rope: RopeTable) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` [1, H, T, D] over the tokens that ``context.loading`` brought: (out, lse)."""
    at, valid, k, v = context.loading.finish()                          # [Hkv, m], [Hkv, m, D]
    k = rope.rotate_heads(k, positions.late_positions(context.first, context.p_mid, at)).to(q.dtype).unsqueeze(0)
    none = ~valid.any(dim=1)                    # heads with nothing missing keep one padding key
    mask = torch.zeros(valid.shape).masked_fill_(~valid, -math.inf)
    mask[none, 0] = 0.0
    out, lse = attend(q, k, v.to(q.dtype).unsqueeze(0), causal=False, mask=mask.view(1, *valid.shape[:1], 1, -1))
    if none.any():                              # ... which then drops out of the merge
        lse[:, none.repeat_interleave(q.shape[1] // valid.shape[0])] = -math.inf
    return out, lse
