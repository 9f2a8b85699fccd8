"""Sparse prefill and decode: each query attends to sinks + chosen chunks + a local window.

Per layer and forward pass (one decode token, or one prefill chunk)::

    q_pre, k_pre, v = project(h)                               before RoPE
    chunks = selector.select(query, index_l, k)                [Hkv, k] per KV head; none while dense
    K, V   = sinks | pages of chunks (keys = A B) + outliers | window     pre-RoPE, token order
             (decode, attend="pages": each head attends more of the pages read, see _widen)
    RoPE   at the real positions, or remapped  0 .. |K|-1 then the queries   (positions="remap")
    out    = merge(attend(q, K, V), attend(q, k_new, v_new, causal))
    seq.append(l, k_pre, v)                                   seals pages past the window

Once layer l has its own pages, a sparse prefetcher (none by default: on CPU
compute a guess costs more than it hides) may start loading layer l+1's
chunks; ``speculative`` guesses them from layer l's input run through layer
l+1's query projection (InfiniGen), so the fetch overlaps the rest of layer
l. Prefetched pages enter their tier cold (see ``tierkv.policy``): a wrong
guess is the first thing evicted, not a page the next step reuses. With
``overlap``, a decode layer attends to its pages in place while the rest load,
then to those (``_attention``): the wait shrinks to what outlasts that compute.

Prefill attends exactly (everything is still in the window) until
``dense_prefill_tokens``; there each layer's key basis is fitted and the
window starts sealing pages. Past that point prefill is sparse too: an
approximation, the price of a 1M-token prompt on a CPU (``tierkv run`` says
so). The prompt's last token is computed by the first decode step, so a
stored index (see ``tierkv.sparse.store``) resumes with no recomputation.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from policies.selectors import make_selector, make_sparse_prefetch
from tierkv.errors import ConfigError
from tierkv.manager import BlockingTierManager
from tierkv.model.arch import apply_rope, decoder_layers, embed, final_logits, finish_attention, mlp_block, \
    project_qkv_pre, project_query_pre, rope_cos_sin
from tierkv.model.attention import attend, merge
from tierkv.model.loading import LoadedModel
from tierkv.events import Event, EventKind
from tierkv.profile.trace import profiler_range
from tierkv.scoring import bound_scores, landmark_scores
from tierkv.sparse.config import SparseConfig
from tierkv.layout import BlockLayout
from tierkv.sparse.sequence import Loading, SparseSequence

# attend="pages": a head attends at most this many times the chunks it selected (SmolLM2: at 8K
# its pages' chunks come to ~2x and lift recall 0.963 -> 0.985; at 128K they come to ~4x, and
# attending all of them doubled the step time)
WIDEN = 2


@dataclass(slots=True)
class _Context:
    """What a layer attends to besides the new tokens: pre-RoPE K, V [Hkv, Tc, D] and real positions
    [Hkv, Tc] of sinks | gathered chunks + outliers | window. With ``loading``, the gathered rows
    (``first`` on, real positions ``p_mid`` [Hkv, M]) of pages still loading are zeros in ``k``, ``v``."""
    k: Tensor
    v: Tensor
    p: Tensor
    loading: Loading | None = None
    first: int = 0
    p_mid: Tensor | None = None

    def mask(self) -> Tensor | None:
        """-inf for the tokens still loading, per KV head [1, Hkv, 1, Tc] (None: nothing is)."""
        if self.loading is None:
            return None
        H, Tc = self.p.shape
        mask = torch.zeros(H, Tc)
        mask[:, self.first:self.first + self.p_mid.shape[1]].masked_fill_(self.loading.missing, -math.inf)
        return mask.view(1, H, 1, Tc)


class SparseEngine:
    def __init__(self, loaded: LoadedModel, manager: BlockingTierManager, config: SparseConfig, *,
                 chunk_tokens: int = 1024, page_dtype: torch.dtype | None = None) -> None:
        spec = loaded.spec
        self.loaded, self.model, self.manager, self.config = loaded, loaded.model, manager, config
        self.layers = decoder_layers(self.model)
        beyond = [layer for layer, _ in config.layer_budgets if layer >= len(self.layers)]
        if beyond:
            raise ConfigError(f"layer_budgets: layer {beyond[0]} is not in the model: it has {len(self.layers)} "
                              f"layers, 0 to {len(self.layers) - 1}")
        self.chunk_tokens = chunk_tokens
        self.rank = config.key_rank(spec.num_kv_heads * spec.head_dim)
        self.layout = BlockLayout.page(config.page_tokens, spec.num_kv_heads, spec.head_dim, self.rank,
                                 page_dtype or spec.dtype)
        self.selector = make_selector(config.selector)
        bind = getattr(self.selector, "bind", None)
        if bind is not None:          # a selector that runs at a tier (near-memory) finds it here
            bind(manager.manager)
        self.prefetcher = make_sparse_prefetch(config.prefetch)
        self.needs = frozenset(self.selector.needs)
        self._cos = self._sin = torch.empty(0, spec.head_dim)       # RoPE table by position, grown on use

    @staticmethod
    def page_layout(loaded: LoadedModel, config: SparseConfig, page_dtype: torch.dtype | None = None) -> BlockLayout:
        spec = loaded.spec
        rank = config.key_rank(spec.num_kv_heads * spec.head_dim)
        return BlockLayout.page(config.page_tokens, spec.num_kv_heads, spec.head_dim, rank, page_dtype or spec.dtype)

    def resolved(self, prompt_tokens: int) -> SparseConfig:
        return self.config.resolve(prompt_tokens=prompt_tokens, trained_tokens=self.loaded.spec.max_position)

    def new_sequence(self, prompt_tokens: int, **kw) -> SparseSequence:
        config = self.resolved(prompt_tokens)
        rotate = None if config.positions == "remap" else self._rotate_keys
        return SparseSequence(self.manager, config, self.layout, num_layers=len(self.layers),
                              dtype=self.loaded.spec.dtype, needs=self.needs, rotate=rotate, **kw)

    # -- prefill and decode ---------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: SparseSequence, ids: Sequence[int], progress: Callable[[int], None] | None = None,
                checkpoint: Callable[[SparseSequence], None] | None = None) -> None:
        """Run every token of ``ids`` (the prompt but its last token) into ``seq``, chunk by chunk,
        from where ``seq`` stands (a resumed prefill starts past its first tokens).

        ``checkpoint(seq)`` is offered the sequence between chunks once every layer has its key
        basis (from there on the state is complete: a stored copy can resume).
        """
        seq.reserve(len(ids) + 1)
        pos = seq.length(0)
        while pos < len(ids):
            end = min(pos + self.chunk_tokens, len(ids))
            if pos < seq.config.dense_prefill_tokens < end:
                end = seq.config.dense_prefill_tokens   # fit the basis exactly where exact prefill ends
            self._begin_step("prefill", end - pos)
            self._forward(seq, ids[pos:end], pos)
            if progress:
                progress(end - pos)
            pos = end
            if checkpoint is not None and pos < len(ids) and seq.fitted():
                checkpoint(seq)
        self.finish_prefill(seq)

    def finish_prefill(self, seq: SparseSequence) -> None:
        """Fit the key basis of layers still without one (a prompt shorter than the exact part)."""
        for layer in range(len(self.layers)):
            seq.fit(layer, self.rank)

    @torch.inference_mode()
    def decode(self, seq: SparseSequence, token: int) -> Tensor:
        """Append one token; returns the logits [vocab] that follow it."""
        self._begin_step("decode", 1)
        h = self._forward(seq, [token], seq.length(0))
        seq.allocation.step_done()
        return final_logits(self.model, h[:, -1:])[0, -1]

    def _begin_step(self, kind: str, tokens: int) -> None:
        """Mark a step in the access trace being recorded, if any (replay models compute per step)."""
        access = self.manager.manager.access
        if access is not None:
            access.begin_step(kind, tokens)

    # -- one forward pass -----------------------------------------------------------------------
    def _forward(self, seq: SparseSequence, chunk: Sequence[int], pos: int) -> Tensor:
        ids = torch.tensor([list(chunk)])
        h = embed(self.model, ids)                                   # [1, T, hidden]
        events = self.manager.manager.events
        speculate = len(chunk) == 1 and getattr(self.prefetcher, "speculates", False)
        for index, layer in enumerate(self.layers):
            start = time.perf_counter()
            with profiler_range(f"tierkv sparse layer {index}"):
                q_pre, k_pre, v = project_qkv_pre(layer, h)          # [1, H, T, D], [1, Hkv, T, D] x2
                query = self._query(seq, q_pre, pos)
                chunks = self._select(seq, index, query, seq.length(index), len(chunk))
                shared = False
                if len(chunk) == 1 and seq.config.attend == "pages":
                    chunks, shared = self._widen(seq, index, query, chunks)
                # decode with overlap: the pages in place are attended to while the rest load (_attention)
                context = self._context(seq, index, chunks, shared=shared,
                                        split=len(chunk) == 1 and seq.config.overlap)
                try:
                    if len(chunk) == 1 and index + 1 < len(self.layers):  # next layer's loads overlap the rest
                        self._prefetch(seq, index + 1, h if speculate else None, pos)
                    out = self._attention(seq, index, q_pre, k_pre, v, pos, context)
                finally:
                    if context.loading is not None:
                        context.loading.abandon()       # an error before it finished: release what arrives
                seq.append(index, k_pre[0].transpose(0, 1), v[0].transpose(0, 1))
                if seq.length(index) >= seq.config.dense_prefill_tokens:
                    seq.fit(index, self.rank)
                h = mlp_block(layer, finish_attention(layer, out, h))
            events.record(Event(EventKind.LAYER, "", "", index, 0, start, start, time.perf_counter()))
        return h

    def _attention(self, seq: SparseSequence, layer: int, q_pre: Tensor, k_pre: Tensor, v: Tensor, pos: int,
                   context: _Context) -> Tensor:
        """Attend to ``context`` and causally to the new tokens. Tokens of pages still loading
        (``context.loading``) are masked out of the first pass and attended once they arrive; the
        parts merge exactly (log-sum-exp), and each token keeps its position either way::

            pass 1   sinks | chunks in place + outliers | window     while the rest load
            pass 2   chunks of the pages that arrived               (per KV head: their counts differ)
        """
        T = q_pre.shape[2]
        k_ctx, v_ctx, p_ctx = context.k, context.v, context.p
        Tc = k_ctx.shape[1]
        remap = seq.config.positions == "remap"
        cos, sin = self._rope_span(Tc if remap else pos, T)
        q, k_new = apply_rope(q_pre, cos.to(q_pre.dtype), sin.to(q_pre.dtype)), \
            apply_rope(k_pre, cos.to(k_pre.dtype), sin.to(k_pre.dtype))
        parts = [attend(q, k_new, v, causal=True)]
        if Tc:
            if remap:       # positions 0 .. Tc-1, the same for every head
                cos, sin = self._rope_span(0, Tc)
                k_ctx = apply_rope(k_ctx.unsqueeze(0), cos, sin).to(q.dtype)
            else:
                k_ctx = self._rotate_heads(k_ctx, p_ctx).to(q.dtype).unsqueeze(0)
            parts.append(attend(q, k_ctx, v_ctx.to(q.dtype).unsqueeze(0), causal=False, mask=context.mask()))
        if context.loading is not None:
            parts.append(self._arrived(q, context, remap))
        return merge(parts)

    def _arrived(self, q: Tensor, context: _Context, remap: bool) -> tuple[Tensor, Tensor]:
        """Attention of ``q`` [1, H, T, D] over the tokens that ``context.loading`` brought: (out, lse)."""
        at, valid, k, v = context.loading.finish()                          # [Hkv, m], [Hkv, m, D]
        positions = context.first + at if remap else context.p_mid.gather(1, at)
        k = self._rotate_heads(k, positions).to(q.dtype).unsqueeze(0)
        none = ~valid.any(dim=1)                    # heads with nothing missing keep one padding key
        mask = torch.zeros(valid.shape).masked_fill_(~valid, -math.inf)
        mask[none, 0] = 0.0
        out, lse = attend(q, k, v.to(q.dtype).unsqueeze(0), causal=False, mask=mask.view(1, *valid.shape[:1], 1, -1))
        if none.any():                              # ... which then drops out of the merge
            lse[:, none.repeat_interleave(q.shape[1] // valid.shape[0])] = -math.inf
        return out, lse

    def _query(self, seq: SparseSequence, q_pre: Tensor, pos: int) -> Tensor:
        """The query a selection scores with [H, D]: mean over the chunk's queries, in the index's frame."""
        if seq.config.positions != "remap":
            cos, sin = self._rope_span(pos, q_pre.shape[2])
            q_pre = apply_rope(q_pre.float(), cos, sin)
        return q_pre[0].float().mean(dim=1)

    def _select(self, seq: SparseSequence, layer: int, query: Tensor, context: int,
                query_tokens: int) -> Tensor:
        index = seq.index(layer)
        if not index.chunks:
            return torch.empty(self.layout.num_kv_heads, 0, dtype=torch.long)
        if query_tokens > 1:
            k = seq.config.budget_tokens(context, prefill=True) // seq.config.chunk_tokens
        else:
            k = self._decode_chunks(seq, layer, context, query)
        chunks = self.selector.select(query, index, k)
        seq.chosen[layer] = chunks
        return chunks

    def _decode_chunks(self, seq: SparseSequence, layer: int, context: int, query: Tensor | None = None) -> int:
        """Chunks ``layer`` selects in a decode step: its budget, times its adaptive share (see
        tierkv.sparse.allocation); given ``query``, a step that re-estimates offers its curve."""
        config, index, alloc = seq.config, seq.index(layer), seq.allocation
        uniform = config.budget_tokens(context, layer=layer) // config.chunk_tokens
        adapts = config.allocation == "adaptive" and index.landmarks is not None and \
            layer not in dict(config.layer_budgets)
        if not adapts or uniform >= index.chunks:      # a budget that covers every chunk stays exact
            return uniform
        if query is not None and alloc.due() and uniform:
            alloc.offer(layer, uniform, query, self._fixed_keys(seq, layer), index.landmarks, index.candidates,
                        chunk_tokens=config.chunk_tokens)
        return round(uniform * alloc.share(layer))

    def _fixed_keys(self, seq: SparseSequence, layer: int) -> Tensor:
        """What ``layer`` always attends (sinks, exact outliers, window): keys [Hkv, F, D] in the
        frame its chunks are scored in."""
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

    def _widen(self, seq: SparseSequence, layer: int, query: Tensor, chunks: Tensor) -> tuple[Tensor, bool]:
        """attend="pages": the chunks [Hkv, m] a decode step attends, given those its heads selected
        [Hkv, k]. The pages read hold every head's tokens; each head attends all of their indexed
        chunks, or, past WIDEN x k of them, its own k plus the rest's best by the summaries the
        selector had the index keep (landmark scores, else Quest bounds): attention compute grows
        with the set, the reads do not. With remapped positions the set also stays within the
        trained window, beside sinks, outliers and window. Returns (chunks, whether every head has
        the same ones)."""
        if not chunks.numel():
            return chunks, False
        wide, (H, k) = seq.page_chunks(layer, chunks), chunks.shape
        cap = WIDEN * k
        if seq.config.positions == "remap":
            config = seq.config
            fixed = config.sink_tokens + config.window_tokens + len(seq.index(layer).outliers) * config.chunk_tokens
            cap = max(k, min(cap, (self.loaded.spec.max_position - fixed - 1) // config.chunk_tokens))
        if wide.numel() <= cap:
            return wide.expand(H, -1), True
        index = seq.index(layer)
        if index.landmarks is not None:
            scores = landmark_scores(query, index.landmarks[wide])
        elif index.lo is not None:
            scores = bound_scores(query, index.lo[wide], index.hi[wide])
        else:
            return chunks, False
        scores.scatter_(1, torch.searchsorted(wide, chunks), float("inf"))     # a head's own chunks stay
        return wide[scores.topk(cap, dim=1, sorted=False).indices.sort(dim=1).values], False

    def _context(self, seq: SparseSequence, layer: int, chunks: Tensor, *, shared: bool = False,
                 split: bool = False) -> _Context:
        """Pre-RoPE K, V [Hkv, Tc, D] and real positions [Hkv, Tc]: sinks | chunks + outliers | window
        (``shared``: every head has the same chunks; ``split``: pages not in place are still loading)."""
        H = self.layout.num_kv_heads
        k_mid, v_mid, p_mid, loading = seq.gather_split(layer, chunks, shared=shared) if split else \
            (*seq.gather(layer, chunks, shared=shared), None)
        sink_k, sink_v = seq.sinks(layer)
        win_k, win_v = seq.window(layer)
        if loading is not None and not (sink_k.shape[0] or win_k.shape[0]):
            at, valid, k_new, v_new = loading.finish()      # nothing to attend meanwhile: a head could
            heads = torch.arange(H).unsqueeze(1).expand_as(at)   # be left with no key at all
            k_mid[heads[valid], at[valid]], v_mid[heads[valid], at[valid]] = k_new[valid], v_new[valid]
            loading = None
        start = seq.length(layer) - win_k.shape[0]
        k = torch.cat([sink_k.float().transpose(0, 1), k_mid, win_k.float().transpose(0, 1)], dim=1)
        v = torch.cat([sink_v.float().transpose(0, 1), v_mid, win_v.float().transpose(0, 1)], dim=1)
        p = torch.cat([torch.arange(sink_k.shape[0]).expand(H, -1), p_mid,
                       torch.arange(start, start + win_k.shape[0]).expand(H, -1)], dim=1)
        return _Context(k, v, p, loading, sink_k.shape[0], p_mid)

    def _prefetch(self, seq: SparseSequence, layer: int, h: Tensor | None, pos: int) -> None:
        index = seq.index(layer)
        if not index.chunks:
            return
        guess = None
        if h is not None:
            q_pre = project_query_pre(self.layers[layer], h)         # [1, H, 1, D]
            k = self._decode_chunks(seq, layer, seq.length(layer) + 1)
            guess = self.selector.select(self._query(seq, q_pre, pos), index, k)
        chunks = self.prefetcher.plan(layer, guess, seq.chosen.get(layer))
        if chunks is not None and chunks.numel():
            seq.prefetch(layer, chunks)

    # -- RoPE ---------------------------------------------------------------------------------------
    def _rotate_heads(self, k_pre: Tensor, positions: Tensor) -> Tensor:
        """k_pre [Hkv, T, D] rotated to per-head positions [Hkv, T]."""
        if positions.shape[0] > 1 and torch.equal(positions[1:], positions[:1].expand(positions.shape[0] - 1, -1)):
            positions = positions[:1]                                # the same for every head: one table
        cos, sin = self._rope(positions)                             # [Hkv or 1, T, D]
        return apply_rope(k_pre.unsqueeze(1).float(), cos, sin).squeeze(1)

    def _rotate_keys(self, k_pre: Tensor, positions: Tensor) -> Tensor:
        """k_pre [t, Hkv, D] at positions [t] -> post-RoPE keys [t, Hkv, D] (the ShadowKV frame)."""
        cos, sin = self._rope(positions.unsqueeze(0))                # [1, t, D]
        return apply_rope(k_pre.transpose(0, 1).unsqueeze(0).float(), cos, sin)[0].transpose(0, 1)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (float32) [*positions.shape, D] from the model's own rotary embedding, tabled."""
        self._grow_rope(int(positions.max()) + 1 if positions.numel() else 0)
        return self._cos[positions], self._sin[positions]

    def _rope_span(self, start: int, n: int) -> tuple[Tensor, Tensor]:
        """cos, sin [1, n, D] of positions start .. start+n-1: views of the table, no gather."""
        self._grow_rope(start + n)
        return self._cos[start:start + n].unsqueeze(0), self._sin[start:start + n].unsqueeze(0)

    def _grow_rope(self, top: int) -> None:
        if top > self._cos.shape[0]:
            size = max(top, 2 * self._cos.shape[0], 4096)
            cos, sin = rope_cos_sin(self.model, torch.arange(size))
            self._cos, self._sin = cos[0].float(), sin[0].float()
