"""Sparse prefill and decode: a model's layers run over a ``SparseSequence``.

Per layer and forward pass (one decode token, or one prefill chunk)::

    q_pre, k_pre, v = project(h)                               before RoPE (model weights: here)
    chunks  = selector.select(query, index_l, budget)          [Hkv, k] per KV head; none while dense
    chunks  = scope.widen(chunks, scores)                      decode, attend="pages" (the selection's
                                                               scores of every chunk, where it shares them)
    context = gather_context(seq, l, chunks)                   tierkv.sparse.step
    out     = attend_layer(q_pre, k_pre, v, context)           tierkv.sparse.step
    seq.append(l, k_pre, v)                                    seals pages past the window

What each choice does (positions, scope, budget, prefill vs decode) is the
sequence's ``StepPlan`` (``tierkv.sparse.plan``), resolved once.

Once layer l has its own pages, a sparse prefetcher (none by default: on CPU
compute a guess costs more than it hides) may start loading layer l+1's
chunks; ``speculative`` guesses them from layer l's input run through layer
l+1's query projection (InfiniGen), so the fetch overlaps the rest of layer
l. Prefetched pages enter their tier cold (see ``tierkv.policy``): a wrong
guess is the first thing evicted, not a page the next step reuses. While an
access trace is recorded, the speculative guess is made and recorded for
every layer whatever the prefetcher, so ``tierkv tune`` can replay it.

Prefill attends exactly (everything is still in the window) until
``dense_prefill_tokens``; there each layer's key basis is fitted and the
window starts sealing pages. Past that point prefill is sparse too: an
approximation, the price of a 1M-token prompt on a CPU (``tierkv run`` says
so). The prompt's last token is computed by the first decode step, so a
stored index (see ``tierkv.sparse.store``) resumes with no recomputation.

A ``probe`` (``SparseEngine(..., probe=f)``) sees every layer's attention as
it is computed: ``f(LayerProbe)`` after the layer's output, with the query,
the new keys and values, the context and the output (``bench/accuracy.py``
compares them to dense attention).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from policies.selectors import make_selector, make_sparse_prefetch
from tierkv.errors import BlockMissing, ConfigError, PassBroken
from tierkv.events import Event, EventKind
from tierkv.layout import BlockLayout, packed_page_tokens
from tierkv.manager import BlockingTierManager
from tierkv.manager.remote import Recompute
from tierkv.model.arch import decoder_layers, embed, final_logits, finish_attention, mlp_block, \
    project_qkv_pre, project_query_pre, recompute_seconds, rope_cos_sin
from tierkv.model.loading import LoadedModel
from tierkv.ops.rope import RopeTable, unrope
from tierkv.policy import SharesScores, implements
from tierkv.profile.trace import profiler_range
from tierkv.sparse.config import SparseConfig
from tierkv.sparse.plan import Phase, StepPlan
from tierkv.sparse.sequence import SparseSequence
from tierkv.sparse.step import Context, attend_layer, gather_context


@dataclass(slots=True)
class LayerProbe:
    """One layer of one forward pass, as the engine computed it (see the module notes)."""

    seq: SparseSequence
    layer: int
    pos: int                # position of the first new token
    q_pre: Tensor           # [1, H, T, D] before RoPE
    k_pre: Tensor           # [1, Hkv, T, D] before RoPE
    v: Tensor               # [1, Hkv, T, D]
    query: Tensor           # [H, D] the query chunks were scored with
    context: Context        # what was attended besides the new tokens (context.p: real positions)
    out: Tensor             # [1, H, T, D] the attention output

    @property
    def decode(self) -> bool:
        return self.q_pre.shape[2] == 1


class SparseEngine:
    def __init__(self, loaded: LoadedModel, manager: BlockingTierManager, config: SparseConfig, *,
                 chunk_tokens: int = 1024, probe: Callable[[LayerProbe], None] | None = None) -> None:
        spec = loaded.spec
        self.loaded, self.model, self.manager, self.config = loaded, loaded.model, manager, config
        self.layers = decoder_layers(self.model)
        beyond = [layer for layer, _ in config.layer_budgets if layer >= len(self.layers)]
        if beyond:
            raise ConfigError(f"layer_budgets: layer {beyond[0]} is not in the model: it has {len(self.layers)} "
                              f"layers, 0 to {len(self.layers) - 1}")
        self.chunk_tokens = chunk_tokens
        self.rank = config.key_rank(spec.num_kv_heads * spec.head_dim)
        self.layout = self.page_layout(loaded, config)
        self.config = config = replace(config, page_tokens=self.layout.tokens)
        if manager.remote is not None:
            manager.price_recompute(Recompute(recompute_seconds(self.model, self.layout.tokens)))
        self.selector = make_selector(config.selector)
        bind = getattr(self.selector, "bind", None)
        if bind is not None:          # a selector that runs at a tier (near-memory) finds it here
            bind(manager.manager)
        self.prefetcher = make_sparse_prefetch(config.prefetch)
        self.needs = frozenset(self.selector.needs)
        self.rope = RopeTable(lambda positions: rope_cos_sin(self.model, positions), spec.head_dim)
        self.probe = probe

    @staticmethod
    def page_layout(loaded: LoadedModel, config: SparseConfig) -> BlockLayout:
        """Pages of ``config.page_tokens`` tokens in ``config.page_dtype`` (None: the model's dtype; a
        quantized page reads back in the model's dtype)."""
        spec, codec = loaded.spec, config.codec
        rank = config.key_rank(spec.num_kv_heads * spec.head_dim)
        dtype = spec.dtype if config.page_dtype is None or codec else getattr(torch, config.page_dtype)
        tokens = config.page_tokens
        try:
            if tokens is None:
                tokens = 16 if codec is None else packed_page_tokens(codec, spec.num_kv_heads, spec.head_dim, rank,
                                                                     dtype, chunk_tokens=config.chunk_tokens)
            return BlockLayout.page(tokens, spec.num_kv_heads, spec.head_dim, rank, dtype, codec=codec)
        except ConfigError as bad:     # a group that does not divide this model's heads or the page
            raise ConfigError(f"page_dtype={config.page_dtype!r}: {bad}") from None

    @property
    def kv_of(self) -> str:
        """Whose KV the pages hold, for a stored index's identity: the model's id, and the dtype it computes
        in where the pages do not say it (float32 pages of a bfloat16 run hold its KV widened, which a
        float32 run would not have computed)."""
        computed = self.loaded.spec.dtype
        return self.loaded.model_id + ("" if self.layout.dtype == computed else
                                       f"+computed-{str(computed).removeprefix('torch.')}")

    def resolved(self, prompt_tokens: int) -> SparseConfig:
        return self.config.resolve(prompt_tokens=prompt_tokens, trained_tokens=self.loaded.spec.max_position)

    def new_sequence(self, prompt_tokens: int, **kw) -> SparseSequence:
        config = self.resolved(prompt_tokens)
        plan = StepPlan.of(config, self.rope, self.loaded.spec.max_position)
        return SparseSequence(self.manager, config, self.layout, num_layers=len(self.layers),
                              dtype=self.loaded.spec.dtype, needs=self.needs, plan=plan, **kw)

    # -- prefill and decode ---------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: SparseSequence, ids: Sequence[int], progress: Callable[[int], None] | None = None,
                checkpoint: Callable[[SparseSequence], None] | None = None, *, until: int | None = None) -> None:
        """Run every token of ``ids`` (the prompt but its last token) into ``seq``, chunk by chunk,
        from where ``seq`` stands (a resumed prefill starts past its first tokens); ``until``: stop
        after the chunk that reaches this many tokens (a repair replaying a stretch).

        ``checkpoint(seq)`` is offered the sequence between chunks once every layer has its key
        basis (from there on the state is complete: a stored copy can resume).
        """
        seq.reserve(len(ids) + 1)
        pos = seq.length(0)
        while pos < len(ids) and (until is None or pos < until):
            end = min(pos + self.chunk_tokens, len(ids))
            if pos < seq.config.dense_prefill_tokens < end:
                end = seq.config.dense_prefill_tokens   # fit the basis exactly where exact prefill ends
            self._begin_step("prefill", end - pos)
            self._forward_or_back(seq, ids[pos:end], pos)
            if progress:
                progress(end - pos)
            pos = end
            if checkpoint is not None and pos < len(ids) and seq.fitted():
                checkpoint(seq)
        if pos >= len(ids):
            self.finish_prefill(seq)

    @torch.inference_mode()
    def seed(self, seq: SparseSequence, tokens: int, kv: Callable[[int], tuple[Tensor, Tensor]]) -> int:
        """Fill an empty ``seq`` with its prompt's first tokens (at most ``tokens``) from KV computed
        already: ``kv(layer)`` gives a layer's post-RoPE keys and values [1, Hkv, >= tokens, D] at real
        positions (a dense run's). That is what ``prefill`` computes of the tokens it attends exactly
        (up to ``dense_prefill_tokens``, at real positions); it goes on from there. Returns the tokens
        taken: none where ``seq`` is not empty or keeps positions of its own, or where the dense run's
        RoPE is not this engine's table (a scaling that depends on the length, as ``dynamic``: the
        layers past the first would differ); where ``kv`` fails, ``seq`` is left empty."""
        tokens = min(tokens, seq.config.dense_prefill_tokens)
        if tokens <= 0 or seq.length(0) or seq.config.positions != "original":
            return 0
        device = self.model.device
        cos, sin = rope_cos_sin(self.model, torch.arange(tokens, device=device))
        if not all(torch.allclose(dense.float().cpu(), own, rtol=0, atol=1e-3)
                   for dense, own in zip((cos, sin), self.rope.span(0, tokens))):
            return 0
        seq.reserve(tokens + 1)
        try:
            for layer in range(len(self.layers)):
                k, v = (x[:, :, :tokens].to(device) for x in kv(layer))
                seq.append(layer, unrope(k, cos, sin)[0].transpose(0, 1), v[0].transpose(0, 1))  # [tokens, Hkv, D]
        except BaseException:
            seq.layers = [seq.new_layer(layer) for layer in range(len(self.layers))]   # nothing was sealed yet
            raise
        if tokens == seq.config.dense_prefill_tokens:
            self.finish_prefill(seq)
        return tokens

    def finish_prefill(self, seq: SparseSequence) -> None:
        """Fit the key basis of layers still without one (a prompt shorter than the exact part)."""
        for layer in range(len(self.layers)):
            seq.fit(layer, self.rank)

    @torch.inference_mode()
    def decode(self, seq: SparseSequence, token: int) -> Tensor:
        """Append one token; returns the logits [vocab] that follow it."""
        self._begin_step("decode", 1)
        h = self._forward_or_back(seq, [token], seq.length(0))
        seq.allocation.step_done()
        return final_logits(self.model, h[:, -1:])[0, -1]

    def _begin_step(self, kind: str, tokens: int) -> None:
        """Mark a step in the access trace being recorded, if any (replay models compute per step)."""
        access = self.manager.access
        if access is not None:
            access.begin_step(kind, tokens)

    # -- one forward pass -----------------------------------------------------------------------
    def _forward_or_back(self, seq: SparseSequence, chunk: Sequence[int], pos: int) -> Tensor:
        """``_forward``; a page that cannot be read leaves ``seq`` as it was before the pass (the layers
        that took the new tokens give them back), so the caller can repair the page and go again; a
        pass longer than the window that sealed pages before it failed cannot: PassBroken."""
        lengths = [state.length for state in seq.layers]
        try:
            return self._forward(seq, chunk, pos)
        except BlockMissing as error:
            if any(state.length - before > len(state.win_k) for state, before in zip(seq.layers, lengths)):
                raise PassBroken(f"{error}; the pass had sealed pages in its first layers and cannot be "
                                 "taken back", error.keys) from error
            for state, before in zip(seq.layers, lengths):
                if state.length > before:
                    state.crop(state.length - before)
            raise

    def _forward(self, seq: SparseSequence, chunk: Sequence[int], pos: int) -> Tensor:
        h = embed(self.model, torch.tensor([list(chunk)]))          # [1, T, hidden]
        events, phase = self.manager.events, seq.plan.phase(len(chunk))
        for index, layer in enumerate(self.layers):
            start = time.perf_counter()
            with profiler_range(f"tierkv sparse layer {index}"):
                h = self._layer(seq, index, layer, h, pos, phase)
            events.record(Event(EventKind.LAYER, "", "", index, 0, start, start, time.perf_counter()))
        return h

    def _layer(self, seq: SparseSequence, index: int, layer: torch.nn.Module, h: Tensor, pos: int,
               phase: Phase) -> Tensor:
        q_pre, k_pre, v = project_qkv_pre(layer, h)                  # [1, H, T, D], [1, Hkv, T, D] x2
        query = seq.plan.positions.scoring_query(q_pre, pos)
        chunks, scores = self._select(seq, index, query, phase)
        chunks, shared = phase.scope.widen(seq, index, query, chunks, scores)
        # with overlap (phase.split) the pages in place are attended to while the rest load
        new = (k_pre[0], v[0], pos) if q_pre.shape[2] == 1 else None   # decode: one pass over context and token
        context = gather_context(seq, index, chunks, shared=shared, split=phase.split, new=new)
        try:
            if phase.prefetch and index + 1 < len(self.layers):    # next layer's loads overlap the rest
                self._prefetch(seq, index + 1, h, pos)
            out = attend_layer(q_pre, k_pre, v, pos, context, seq.plan.positions, self.rope)
        finally:
            context.abandon()
        if self.probe is not None:
            self.probe(LayerProbe(seq, index, pos, q_pre, k_pre, v, query, context, out))
        seq.append(index, k_pre[0].transpose(0, 1), v[0].transpose(0, 1))
        if seq.length(index) >= seq.config.dense_prefill_tokens:
            seq.fit(index, self.rank)
        return mlp_block(layer, finish_attention(layer, out, h))

    def _select(self, seq: SparseSequence, layer: int, query: Tensor, phase: Phase) -> tuple[Tensor, Tensor | None]:
        """The chunks [Hkv, k] ``layer`` selects, and every chunk's landmark scores where the selector
        computed them (`SharesScores`; None otherwise)."""
        index = seq.index(layer)
        if not index.chunks:
            return torch.empty(self.layout.num_kv_heads, 0, dtype=torch.long), None
        k = phase.budget.chunks(seq, layer, seq.length(layer), query)
        if implements(self.selector, SharesScores):
            chunks, scores = self.selector.select_scored(query, index, k)
        else:
            chunks, scores = self.selector.select(query, index, k), None
        seq.chosen[layer] = chunks
        return chunks, scores

    def _prefetch(self, seq: SparseSequence, layer: int, h: Tensor, pos: int) -> None:
        """Layer ``layer``'s pages to load during the layer before it, as the prefetcher plans them;
        while a trace is recorded, the speculative guess too (as a guess, not a load)."""
        index, access = seq.index(layer), self.manager.access
        if not index.chunks:
            return
        recording = access is not None and hasattr(access, "on_guess")
        guess = None
        speculates = getattr(self.prefetcher, "speculates", False)
        if speculates or recording:
            guess = self.guess(seq, layer, h, pos)
        if recording:
            access.on_guess(seq.page_keys(layer, guess), layer, "speculative")
        chunks = self.prefetcher.plan(layer, guess if speculates else None, seq.chosen.get(layer))
        if chunks is not None and chunks.numel():
            seq.prefetch(layer, chunks)

    def guess(self, seq: SparseSequence, layer: int, h: Tensor, pos: int) -> Tensor:
        """The chunks [Hkv, k] ``layer`` would select for a query made from the previous layer's
        input ``h`` (InfiniGen's speculation)."""
        q_pre = project_query_pre(self.layers[layer], h)             # [1, H, 1, D]
        k = seq.plan.decode.budget.chunks(seq, layer, seq.length(layer) + 1, None)
        return self.selector.select(seq.plan.positions.scoring_query(q_pre, pos), seq.index(layer), k)
