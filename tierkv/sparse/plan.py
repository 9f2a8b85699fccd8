"""The choices a sparse step makes, resolved once per sequence into small strategy objects.

``SparseConfig`` names each choice by a string; a sequence's ``StepPlan`` holds
the objects those names stand for, so the step itself never compares strings::

    positions   real     every key at its own RoPE position; chunks scored after RoPE
                remap    attended keys at compact positions 0..Tc-1, then the queries, so a
                         context past the trained window stays inside it; scored before RoPE
    scope       chunks   a decode step attends each KV head's own chunks
                pages    ... and the other chunks of the pages it read, up to WIDEN x its own
    budget      uniform  every layer its configured budget
                adaptive moved between layers at the same total (tierkv.sparse.allocation)
    phase       prefill  a chunk of prompt tokens: the prefill budget, own chunks, no overlap,
                         no prefetch
                decode   one token: the decode budget and scope, overlap and prefetch as set
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from tierkv.ops.rope import RopeTable, apply_rope
from tierkv.scoring import bound_scores, chunk_rows, landmark_scores, landmark_values, top_indices
from tierkv.sparse.config import SparseConfig

if TYPE_CHECKING:
    from tierkv.sparse.sequence import SparseSequence

Rotate = Callable[[Tensor, Tensor], Tensor]   # (k_pre [t, Hkv, D], positions [t]) -> keys in the scoring frame

# attend="pages": a head attends at most this many times the chunks it selected (SmolLM2: at 8K
# its pages' chunks come to ~2x and lift recall 0.963 -> 0.985; at 128K they come to ~4x, and
# attending all of them doubled the step time)
WIDEN = 2


# -- positions ----------------------------------------------------------------------------------
class Positions(Protocol):
    rotate: Rotate | None      # sealed keys into the frame chunks are scored in (None: pre-RoPE)

    def scoring_query(self, q_pre: Tensor, pos: int) -> Tensor: ...

    def query_start(self, context_tokens: int, pos: int) -> int: ...

    def rotate_new(self, x: Tensor, start: int) -> Tensor: ...

    def context_keys(self, k_ctx: Tensor, p_ctx: Tensor) -> Tensor: ...

    def late_positions(self, first: int, p_mid: Tensor, at: Tensor) -> Tensor: ...

    def widen_cap(self, cap: int, own: int, fixed_tokens: int, chunk_tokens: int) -> int: ...


@dataclass(slots=True)
class RealPositions:
    """Every key at its own position: the index scores the query after RoPE at ``pos``."""

    rope: RopeTable

    @property
    def rotate(self) -> Rotate:
        return self.rope.rotate_tokens

    def scoring_query(self, q_pre: Tensor, pos: int) -> Tensor:
        """q_pre [1, H, T, D] -> the query a selection scores with [H, D]: the mean of the chunk's."""
        cos, sin = self.rope.span(pos, q_pre.shape[2])
        return apply_rope(q_pre.float(), cos, sin)[0].mean(dim=1)

    def query_start(self, context_tokens: int, pos: int) -> int:
        return pos

    def rotate_new(self, x: Tensor, start: int) -> Tensor:
        """The new tokens' queries or keys x [1, H, T, D] at positions start .. start+T-1, rounded as the
        model rounds them (a dense reference sees these)."""
        cos, sin = self.rope.span(start, x.shape[2], x.dtype)
        return apply_rope(x, cos, sin)

    def context_keys(self, k_ctx: Tensor, p_ctx: Tensor) -> Tensor:
        """k_ctx [Hkv, Tc, D] pre-RoPE at positions p_ctx [Hkv, Tc] -> [1, Hkv, Tc, D] rotated."""
        return self.rope.rotate_heads(k_ctx, p_ctx).unsqueeze(0)

    def late_positions(self, first: int, p_mid: Tensor, at: Tensor) -> Tensor:
        return p_mid.gather(1, at)

    def widen_cap(self, cap: int, own: int, fixed_tokens: int, chunk_tokens: int) -> int:
        return cap


@dataclass(slots=True)
class CompactPositions:
    """Attended keys at positions 0 .. Tc-1 and the queries after them (``positions="remap"``)."""

    rope: RopeTable
    trained_tokens: int
    rotate: Rotate | None = None

    def scoring_query(self, q_pre: Tensor, pos: int) -> Tensor:
        return q_pre[0].float().mean(dim=1)

    def query_start(self, context_tokens: int, pos: int) -> int:
        return context_tokens

    def rotate_new(self, x: Tensor, start: int) -> Tensor:
        """As the context's keys are rotated (``context_keys``): two operations, not apply_rope's dozen."""
        return self.rope.rotate_span(x, start)

    def context_keys(self, k_ctx: Tensor, p_ctx: Tensor) -> Tensor:
        """Rotated in the keys' own dtype, as the model rotates its keys and the step its new ones (bf16
        keys widened to float32 for it took ~10x as long: 8.7 against 0.8 ms for 5.6K keys a layer), by
        the fused rotation: no dense reference sees keys at compact positions."""
        return self.rope.rotate_span(k_ctx.unsqueeze(0), 0)

    def late_positions(self, first: int, p_mid: Tensor, at: Tensor) -> Tensor:
        return first + at

    def widen_cap(self, cap: int, own: int, fixed_tokens: int, chunk_tokens: int) -> int:
        """Widening keeps the compact context inside the trained window."""
        return max(own, min(cap, (self.trained_tokens - fixed_tokens - 1) // chunk_tokens))


# -- scope: what a decode step attends of what it read ------------------------------------------------
class Scope(Protocol):
    def widen(self, seq: SparseSequence, layer: int, query: Tensor, chunks: Tensor,
              scores: Tensor | None = None) -> tuple[Tensor, bool]: ...


class OwnChunks:
    """Each KV head attends the chunks it selected."""

    def widen(self, seq: SparseSequence, layer: int, query: Tensor, chunks: Tensor,
              scores: Tensor | None = None) -> tuple[Tensor, bool]:
        return chunks, False


class WholePages:
    def widen(self, seq: SparseSequence, layer: int, query: Tensor, chunks: Tensor,
              scores: Tensor | None = None) -> tuple[Tensor, bool]:
        """The chunks [Hkv, m] a decode step attends, given those its heads selected [Hkv, k]. The
        pages read hold every head's tokens; each head attends all of their indexed chunks, or,
        past WIDEN x k of them, its own k plus the rest's best by the summaries the selector had the
        index keep (landmark scores, else Quest bounds): attention compute grows with the set, the
        reads do not. ``scores``: the landmark scores [Hkv, C] of every chunk where the selection
        computed them (`SharesScores`), taken instead of scoring the pages' chunks again. Returns
        (chunks, whether every head has the same ones)."""
        if not chunks.numel():
            return chunks, False
        wide, (H, k) = seq.page_chunks(layer, chunks), chunks.shape
        config, index = seq.config, seq.index(layer)
        fixed = config.sink_tokens + config.window_tokens + len(index.outliers) * config.chunk_tokens
        cap = seq.plan.positions.widen_cap(WIDEN * k, k, fixed, config.chunk_tokens)
        if wide.numel() <= cap:
            return wide.expand(H, -1), True
        if index.landmarks is not None and scores is not None:
            scores = scores[:, wide]
        elif index.landmarks is not None:
            scale = index.landmark_scale
            scores = landmark_scores(query, chunk_rows(index.landmarks, wide), None if scale is None else scale[wide])
        elif index.lo is not None:
            scores = bound_scores(query, chunk_rows(index.lo, wide), chunk_rows(index.hi, wide))
        else:
            return chunks, False
        scores.scatter_(1, torch.searchsorted(wide, chunks), float("inf"))     # a head's own chunks stay
        return wide[top_indices(scores, cap)], False


# -- budgets: chunks a layer selects ------------------------------------------------------------------
class Budget(Protocol):
    def chunks(self, seq: SparseSequence, layer: int, context: int, query: Tensor | None) -> int: ...


class PrefillBudget:
    def chunks(self, seq: SparseSequence, layer: int, context: int, query: Tensor | None) -> int:
        return seq.config.budget_tokens(context, prefill=True) // seq.config.chunk_tokens


class UniformBudget:
    def chunks(self, seq: SparseSequence, layer: int, context: int, query: Tensor | None) -> int:
        return seq.config.budget_tokens(context, layer=layer) // seq.config.chunk_tokens


class AdaptiveBudget:
    """The uniform budget times the layer's share (tierkv.sparse.allocation); given ``query``, a
    step that re-estimates offers the layer's coverage curve."""

    def chunks(self, seq: SparseSequence, layer: int, context: int, query: Tensor | None) -> int:
        config, index, alloc = seq.config, seq.index(layer), seq.allocation
        uniform = UniformBudget().chunks(seq, layer, context, query)
        pinned = layer in dict(config.layer_budgets)
        if pinned or index.landmarks is None or uniform >= index.chunks:   # covering every chunk stays exact
            return uniform
        if query is not None and alloc.due() and uniform:
            landmarks = landmark_values(index.landmarks, index.landmark_scale)
            alloc.offer(layer, uniform, query, fixed_keys(seq, layer), landmarks, index.candidates,
                        chunk_tokens=config.chunk_tokens)
        return round(uniform * alloc.share(layer))


def fixed_keys(seq: SparseSequence, layer: int) -> Tensor:
    """What ``layer`` always attends (sinks, exact outliers, window): keys [Hkv, F, D] in the frame
    its chunks are scored in."""
    c, S = seq.config.chunk_tokens, seq.config.sink_tokens
    sink_k, _ = seq.sinks(layer)
    win_k, _ = seq.window(layer)
    ids, k_out, _ = seq.index(layer).exact()
    start = seq.length(layer) - win_k.shape[0]
    keys = [sink_k.float(), win_k.float()]
    positions = [torch.arange(sink_k.shape[0]), torch.arange(start, start + win_k.shape[0])]
    if ids.numel():
        keys.append(k_out.float())
        positions.append(((S + ids * c).unsqueeze(-1) + torch.arange(c)).flatten())
    k = torch.cat(keys)                                          # [F, Hkv, D]
    if seq.rotate is not None:
        k = seq.rotate(k, torch.cat(positions))
    return k.transpose(0, 1)


# -- the plan ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Phase:
    """What one forward pass does, prefill chunk or decode token."""

    budget: Budget
    scope: Scope
    split: bool          # attend the pages in place while the rest load (overlap)
    prefetch: bool       # start loading layer l+1's guessed pages during layer l


@dataclass(frozen=True, slots=True)
class StepPlan:
    positions: Positions
    prefill: Phase
    decode: Phase

    @classmethod
    def of(cls, config: SparseConfig, rope: RopeTable, trained_tokens: int) -> StepPlan:
        """The plan of a resolved config (``positions`` is ``real`` or ``remap``, see ``resolve``)."""
        positions = {"remap": lambda: CompactPositions(rope, trained_tokens),
                     "original": lambda: RealPositions(rope)}[config.positions]()
        scope = {"pages": WholePages, "chunks": OwnChunks}[config.attend]()
        budget = {"uniform": UniformBudget, "adaptive": AdaptiveBudget}[config.allocation]()
        return cls(positions, Phase(PrefillBudget(), OwnChunks(), split=False, prefetch=False),
                   Phase(budget, scope, split=config.overlap, prefetch=True))

    def phase(self, tokens: int) -> Phase:
        """A pass over one token decodes; over more, it prefills."""
        return self.decode if tokens == 1 else self.prefill
