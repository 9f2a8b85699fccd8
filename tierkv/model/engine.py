"""The native long-context loop: chunked prefill and dense decode over tiered KV.

Context length is bounded by disk, not by memory: each prompt chunk attends
to the KV already stored, read back from the tiers a block at a time and
merged by log-sum-exp (online softmax), then causally to itself::

    for each chunk of tokens [s, e):                  (chunk_tokens, a multiple of block_tokens)
      for each layer l:                               (layer l+1's first blocks are prefetched)
        q, k, v = project(h)
        out = merge(attend(q, K_b, V_b) for each stored block b of layer l,
                    attend(q, k, v, causal))
        seq.append(l, k, v)        full blocks sealed into the tiers; written back behind the compute
        h = mlp(h + o_proj(out))

Decode runs the same step on one token. Keys are stored after RoPE; the
pre-RoPE keys that sparse selection needs are recovered exactly with
``tierkv.ops.rope.unrope`` from the block's positions.

Prefill once, decode many: blocks are content addresses of the token prefix,
so a later run over the same document finds them in the NVMe store (or a
sequence of the same process in its memory tiers) and starts after the last
whole block they cover. A block that is lost or fails its
checksum is never served: the loop rewinds to the chunk that produced it and
recomputes from there.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from policies.prefetch import make_prefetch
from tierkv.device import has_cuda
from tierkv.errors import BlockMissing, ConfigError
from tierkv.manager import BlockingTierManager
from tierkv.manager.remote import Recompute
from tierkv.model.arch import ModelSpec, decoder_layers, embed, final_logits, finish_attention, mlp_block, \
    project_qkv, recompute_seconds, rope_cos_sin
from tierkv.ops.attention import attend, block_lse, block_mass, merge_lse
from tierkv.model.loading import LoadedModel
from tierkv.codec import KVCodec, block_codec
from tierkv.layout import BlockLayout
from tierkv.model.kv_buffer import BufferBudget
from tierkv.model.sequence import TieredSequence
from tierkv.events import Event, EventKind
from tierkv.profile.trace import profiler_range

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_tokens: int = 256
    chunk_tokens: int = 1024
    reuse: bool = True
    max_rewinds: int = 8   # recomputations after lost blocks before giving up
    prefetch: str = "next-layer"   # a policies.prefetch name: which blocks of layer l+1 load during layer l
    kv_dtype: str | None = None    # sealed blocks quantized (int8, int4, int2: tierkv.codec), or as computed
    buffer: int | None = None      # bytes of per-layer K/V buffers on the compute device (None: the gpu tier's)

    def __post_init__(self) -> None:
        for name in ("block_tokens", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")
        if self.buffer is not None and self.buffer < 0:
            raise ConfigError(f"buffer={self.buffer}: must be >= 0 bytes (0: no buffers)")
        if self.chunk_tokens % self.block_tokens:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens}: must be a multiple of "
                              f"block_tokens={self.block_tokens}")
        make_prefetch(self.prefetch)  # unknown names list the valid ones
        try:
            block_codec(self.kv_dtype, self.block_tokens)
        except ConfigError as bad:
            raise ConfigError(f"kv_dtype={bad}") from None

    @property
    def codec(self) -> KVCodec | None:
        return block_codec(self.kv_dtype, self.block_tokens)

    def layout(self, spec: ModelSpec) -> BlockLayout:
        """The blocks this engine seals for a model of ``spec``."""
        try:
            return BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, self.block_tokens,
                                  codec=self.codec)
        except ConfigError as bad:     # a group that does not divide this model's heads
            raise ConfigError(f"kv_dtype={self.kv_dtype!r}: {bad}") from None


class Engine:
    """Runs a loaded model over a ``TieredSequence``; one engine serves many sequences."""

    def __init__(self, loaded: LoadedModel, manager: BlockingTierManager,
                 config: EngineConfig = EngineConfig()) -> None:
        spec = loaded.spec
        self.loaded = loaded
        self.model = loaded.model
        self.manager = manager
        self.config = config
        self.layers = decoder_layers(self.model)
        self.layout = config.layout(spec)
        if manager.remote is not None:
            manager.price_recompute(Recompute(recompute_seconds(self.model, config.block_tokens)))
        self.prefetch = make_prefetch(config.prefetch)
        self.scores = manager.wants_scores   # a policy ranks blocks by attention (h2o): report it
        # reuse=False: blocks of earlier runs are not found (another root), those of this engine's
        # own sequences are (a reused document, a fork)
        self._salt = "" if config.reuse else "/" + os.urandom(8).hex()
        gpu = manager.tier("gpu")          # the buffers' default: as many bytes as the gpu tier
        self.buffers = BufferBudget(config.buffer if config.buffer is not None else gpu.budget_bytes if gpu else 0)

    @property
    def keeps_blocks(self) -> bool:
        """Whether sealed blocks are kept for later runs: a store holds them, and they can be found again
        (``reuse=False`` salts their keys: kept, they would only fill the store)."""
        return self.manager.persists and self.config.reuse

    def new_sequence(self) -> TieredSequence:
        persist = self.keeps_blocks
        seq = TieredSequence(self.manager, self.layout, model_id=self.loaded.model_id + self._salt, persist=persist,
                             budget=self.buffers if self.buffers.limit and not self.scores else None,
                             device=self.model.device)
        seq.read_tier = "gpu" if has_cuda() else None
        return seq

    # -- prefill -------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: TieredSequence, ids: Sequence[int],
                progress: Callable[[int], None] | None = None) -> tuple[Tensor, int]:
        """Run the prompt; returns (logits of its last token [vocab], reused prompt tokens)."""
        if not ids:
            raise ValueError("the prompt is empty")
        seq.add_tokens(ids)
        reused = self._reuse(seq, 0)
        if progress and reused:
            progress(reused)
        logits, computed_from = self._extend(seq, reused, progress)
        return logits, min(reused, computed_from)     # (a damaged stored block made it compute from earlier)

    def _reuse(self, seq: TieredSequence, held: int) -> int:
        """Adopt the stored blocks of the longest stored prefix past the ``held`` tokens ``seq`` computed
        (all of a prompt, or what follows a state's tokens: a conversation the session let go of but
        stored); returns the first token to compute (at least one is left). A partial last block gives
        way to the stored block that holds its tokens. The rest is computed from there on the usual chunk
        grid (the first chunk ends at the next multiple of chunk_tokens), so a reused prompt computes the
        tokens a fresh one would, in the same chunks past that point."""
        T = self.config.block_tokens
        whole, usable = held // T, (len(seq.token_ids) - 1) // T
        found = whole
        # past a state, only the local tiers are asked: a remote store's miss would cost every turn a round trip
        while found < usable and self.manager.protect(self._layer_keys(seq, found), remote=not held):
            found += 1
        if found == whole:
            return held
        if held % T:
            for state in seq.layers:          # (its tokens' KV as the stored block has it)
                state.crop(held % T, keep=seq.persist)
        for index in range(whole, found):
            for layer, key in enumerate(self._layer_keys(seq, index)):
                seq.adopt(layer, key)
        return found * T

    def _layer_keys(self, seq: TieredSequence, index: int) -> list:
        return [seq.block_key(layer, index) for layer in range(self.layout.num_layers)]

    def _extend(self, seq: TieredSequence, start: int, progress: Callable[[int], None] | None, *,
                every: bool = False) -> tuple[Tensor, int]:
        """Compute tokens ``seq.token_ids[start:]`` chunk by chunk; returns the last logits [vocab] (or
        with ``every`` the logits after each of those tokens [n, vocab]), and the first token computed
        (before ``start`` where a block it read was lost or damaged)."""
        pos, rewinds, first = start, 0, start
        chunks: dict[int, Tensor] = {}          # first position -> logits after each of its tokens
        while pos < len(seq.token_ids):
            end = min(pos - pos % self.config.chunk_tokens + self.config.chunk_tokens, len(seq.token_ids))
            try:
                chunks[pos] = self._forward(seq, seq.token_ids[pos:end], pos, every=every)
            except BlockMissing as lost:
                rewinds += 1
                if rewinds > self.config.max_rewinds:
                    raise
                back = self._rewind(seq, lost, scrub=rewinds == 1)
                if progress:
                    progress(back - pos)          # (negative: the tokens found stored, then lost, count no more)
                pos, first = back, min(first, back)
                continue
            if progress:
                progress(end - pos)
            pos = end
        if not every:
            return chunks[max(chunks)], first
        rows = torch.cat([chunks[p] for p in sorted(chunks) if p + len(chunks[p]) > start])
        return rows[start - min(p for p in chunks if p + len(chunks[p]) > start):], first

    def _rewind(self, seq: TieredSequence, lost: BlockMissing, *, scrub: bool) -> int:
        """Truncate to the chunk that produced the first missing block; returns where to resume.
        ``scrub``: first check every stored block the sequence holds (a damaged block seldom comes
        alone: one rewind then covers them all, where each would cost one as the passes met it)."""
        T, C = self.config.block_tokens, self.config.chunk_tokens
        keys = [k for layer in seq.blocks for k in layer]
        unstored = set(self.manager.scrub(keys)) if scrub else set()
        first = min((i for layer in seq.blocks for i, k in enumerate(layer)
                     if k in unstored or not self.manager.contains(k)), default=len(seq.blocks[0]))
        boundary = first * T // C * C
        ids = list(seq.token_ids)
        what = f"{len(unstored)} of its {len(keys)} block(s) are damaged or lost" if scrub else "a block is lost"
        log.warning("%s; %s: computing the sequence again from token %d", lost, what, boundary)
        seq.truncate(boundary // T)
        seq.add_tokens(ids[boundary:])
        return boundary

    @torch.inference_mode()
    def extend(self, seq: TieredSequence, ids: Sequence[int], progress: Callable[[int], None] | None = None,
               *, every: bool = False) -> tuple[Tensor, int]:
        """Compute ``ids`` after what ``seq`` holds; returns the logits [vocab] that follow them (``every``:
        the logits after each of them [len(ids), vocab], as a draft's verification needs) and the first
        position computed (past the start of ``ids`` where the store holds their blocks, before it where a
        stored block it read was lost)."""
        held = len(seq.token_ids)
        seq.add_tokens(ids)
        start = held if every else self._reuse(seq, held)      # (a draft's verification: every token's logits)
        if progress and start > held:
            progress(start - held)
        return self._extend(seq, start, progress, every=every)

    # -- decode ----------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seq: TieredSequence, token: int) -> Tensor:
        """Append one token and return the logits [vocab] that follow it."""
        seq.add_tokens([token])
        return self._extend(seq, len(seq.token_ids) - 1, None)[0]

    # -- one forward pass over new tokens --------------------------------------
    def _forward(self, seq: TieredSequence, chunk: Sequence[int], pos: int, *, every: bool = False) -> Tensor:
        ids = torch.tensor([list(chunk)], device=self.model.device)
        positions = torch.arange(pos, pos + len(chunk), device=self.model.device)
        cos, sin = rope_cos_sin(self.model, positions)
        h = embed(self.model, ids)
        events, access = self.manager.events, self.manager.access
        if access is not None:
            access.begin_step("decode" if len(chunk) == 1 else "prefill", len(chunk))
        for index, layer in enumerate(self.layers):
            start = time.perf_counter()
            if index + 1 < len(self.layers) and seq.reads_blocks(index + 1):
                seq.prefetch_layer(index + 1, self.manager.pin_group(), self.prefetch)
            with profiler_range(f"tierkv layer {index}"):
                q, _, k, v = project_qkv(layer, h, cos, sin)
                if len(chunk) == 1:      # one token sees every key, itself too: stored first, one attention
                    seq.append(index, k, v)
                    out = self._attention(seq, index, q, scored=self.scores)
                else:
                    out = self._attention(seq, index, q, k, v)
                    seq.append(index, k, v)
                h = mlp_block(layer, finish_attention(layer, out, h))
            events.record(Event(EventKind.LAYER, "", "", index, 0, start, start, time.perf_counter()))
        return final_logits(self.model, h)[0] if every else final_logits(self.model, h[:, -1:])[0, -1]

    def _attention(self, seq: TieredSequence, layer: int, q: Tensor, k: Tensor | None = None,
                   v: Tensor | None = None, *, scored: bool = False) -> Tensor:
        """q over every stored block, the tail, then the new tokens ``k``, ``v`` (causal; None: they are
        stored already), merged exactly.

        ``scored``: also report the attention mass of each stored block to the manager (decode only:
        it costs one more q·k product per group).
        """
        parts = [] if k is None else [attend(q, k, v, causal=True)]
        whole = None if scored else seq.contiguous(layer)
        if whole is not None:       # one kernel call over the layer's buffer
            if whole[0].shape[2]:
                parts.append(attend(q, whole[0], whole[1], causal=False))
            return merge_lse(parts)[0]
        block_lses: list[Tensor] = []                                          # [B, H, Tq, g] per group
        for _, blocks in seq.block_groups(layer, self.manager.pin_group()):
            # one kernel call per group: concatenating is cheaper than a merge per block
            group_k = torch.cat([bk for bk, _ in blocks], dim=2).to(q.device)   # [B, Hkv, g*T, D]
            group_v = torch.cat([bv for _, bv in blocks], dim=2).to(q.device)
            parts = [merge_lse([*parts, attend(q, group_k, group_v, causal=False)])]
            if scored:
                block_lses.append(block_lse(q, group_k, self.layout.tokens))
        tail_k, tail_v = seq.tail(layer)
        if tail_k.shape[2]:
            parts.append(attend(q, tail_k.to(q.device), tail_v.to(q.device), causal=False))
        out, lse = merge_lse(parts)
        if block_lses:
            masses = block_mass(torch.cat(block_lses, dim=-1), lse).tolist()
            self.manager.observe(list(zip(seq.blocks[layer], masses)))
        return out

