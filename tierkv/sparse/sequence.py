"""The KV of one sequence under sparse attention: sinks, indexed pages, a local window.

Per layer, tokens fall into three regions::

    tokens   0 .. S-1   | S ........................ sealed-1 | sealed .. n-1
             sinks      | indexed: pages in the tiers          | window
             exact, RAM | values + key factors per page;       | exact (pre-RoPE K, V), RAM
                        | summaries + outliers in ChunkIndex   |

New tokens enter the window. Until the layer's key basis is fitted (the
exact-prefill part), nothing is sealed and attention over sinks + window is
dense. Afterwards, whenever the window holds a page more than
``window_tokens``, its oldest page is sealed: keys projected on the basis,
chunk summaries and outliers indexed, the page put into the tier manager.

Reading (`tierkv.sparse.reads.PageReader`): for chunks chosen per KV head,
the pages holding them are pinned through the manager (pages kept from the
previous step are found in place: ShadowKV's cross-step reuse), keys rebuilt
from the factors, and each head's chunks gathered in token order, merged with
the outliers. A page holds every head's tokens, so a decode step may attend
more of the pages read than the chunks chosen (``page_chunks``; see
``SparseEngine`` and ``SparseConfig.attend``). ``gather_split`` returns once
the pages in place are copied, and a ``Loading`` brings the rest
(``SparseConfig.overlap``).
"""
from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey
from tierkv.manager import BlockingTierManager
from tierkv.ops.rows import put_rows
from tierkv.sparse.allocation import Allocation
from tierkv.sparse.config import SparseConfig
from tierkv.sparse.index import ChunkIndex
from tierkv.sparse.layer_state import LayerState
from tierkv.sparse.lowrank import project
from tierkv.sparse.order import Placed, ascending, merge_slots, page_set, page_slots, token_rows
from tierkv.sparse.plan import StepPlan
from tierkv.sparse.reads import Loading, PageReader
from tierkv.layout import BlockLayout

if TYPE_CHECKING:
    from tierkv.sparse.restore import Origin


@dataclass(slots=True)
class ReadStats:
    steps: int = 0            # layer reads
    pages: int = 0            # pages read
    reused: int = 0           # of those, pages the same layer read in the previous step
    tokens: int = 0           # tokens attended from pages and outliers (per KV head)


class SparseSequence:
    def __init__(self, manager: BlockingTierManager, config: SparseConfig, layout: BlockLayout, *,
                 num_layers: int, dtype: torch.dtype, needs: frozenset[str], plan: StepPlan | None = None,
                 root: BlockKey | None = None, persist: bool = False) -> None:
        self.manager, self.config, self.layout = manager, config, layout
        self.plan = plan                         # the step's strategies (tierkv.sparse.plan); None: no model
        # sealed keys into the frame chunks are scored in (None: pre-RoPE, as remapped positions score)
        self.rotate = None if plan is None else plan.positions.rotate
        self.root = root or BlockKey.of("private-sparse", os.urandom(16))
        self.persist = persist
        # per layer, how many of its first pages are keyed for reuse (a stored document's); the rest are this
        # lineage's own, under private roots, which no run can find again (None: every page is for reuse)
        self.shared_pages: list[int] | None = None if root is not None else [0] * num_layers
        self.read_tier: str | None = None
        self.reader = PageReader(manager, layout)
        self._layer_args = (needs, dtype)
        self.layers = [self.new_layer(i) for i in range(num_layers)]
        self.stats = ReadStats()
        self.chosen: dict[int, Tensor] = {}      # layer -> chunks chosen in the last step
        self.allocation = Allocation()           # decode budgets per layer (tierkv.sparse.allocation)
        self.resumed_tokens = 0                  # prompt tokens a stopped prefill had saved
        self.prefill_s = 0.0                     # seconds of prefill behind the state, all runs
        self.document_tokens = 0                 # tokens of the stored prefix state this one started from
        self.origin: Origin | None = None        # the stored state its first pages are (a repair replays it)

    def fork(self) -> SparseSequence:
        """A branch of the same tokens: it holds every page too (a stored document stays whole while
        its branches come and go), shares what never changes, and keys the pages it seals under a
        private root, so two branches never see each other's tokens (``LayerState.fork``)."""
        missing = self.manager.hold(self.all_pages())
        if missing:
            gone = set(missing)
            self.manager.unprotect([key for key in self.all_pages() if key not in gone])
            raise BlockMissing(f"{len(missing)} page(s) of the sequence to fork are no longer stored", tuple(missing))
        twin = copy.copy(self)
        twin.layers = [state.fork() for state in self.layers]
        twin.root, twin.persist = BlockKey.of("private-sparse", os.urandom(16)), False
        twin.shared_pages = self._shared_counts()
        twin.stats, twin.chosen = ReadStats(), dict(self.chosen)
        twin.allocation = replace(self.allocation, shares=dict(self.allocation.shares), curves={}, uniform={})
        return twin

    def crop(self, tokens: int) -> None:
        """Forget the newest ``tokens`` tokens in every layer (``LayerState.crop``)."""
        for state in self.layers:
            state.crop(tokens)

    def detach(self) -> None:
        """From now on the pages this sequence seals are its own (a private root, not stored for reuse):
        it goes past the state it was loaded or prefilled as."""
        self.shared_pages = self._shared_counts()
        self.root, self.persist = BlockKey.of("private-sparse", os.urandom(16)), False

    def _shared_counts(self) -> list[int]:
        if self.shared_pages is not None:
            return list(self.shared_pages)
        return [len(state.pages) for state in self.layers]

    def new_layer(self, layer: int) -> LayerState:
        """An empty state for ``layer`` (a stored index is read into fresh ones, then swapped in)."""
        return LayerState(layer, self.config, self.layout, *self._layer_args)

    # -- regions ------------------------------------------------------------------
    def length(self, layer: int) -> int:
        return self.layers[layer].length

    def sealed(self, layer: int) -> int:
        """First token of the window."""
        return self.config.sink_tokens + len(self.layers[layer].pages) * self.layout.tokens

    def index(self, layer: int) -> ChunkIndex:
        return self.layers[layer].index

    def sinks(self, layer: int) -> tuple[Tensor, Tensor]:
        state = self.layers[layer]
        return state.sink_k, state.sink_v

    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        state = self.layers[layer]
        return state.win_k.rows(), state.win_v.rows()

    def basis(self, layer: int) -> Tensor | None:
        return self.layers[layer].basis.basis

    def fitted(self) -> bool:
        """Every layer has its key basis (the exact part of the prefill is over)."""
        return all(state.basis.basis is not None for state in self.layers)

    def reserve(self, tokens: int) -> None:
        """Size each layer's chunk index for ``tokens`` in all (no growth room wasted on a long prompt)."""
        chunks = max(0, tokens - self.config.sink_tokens) // self.config.chunk_tokens
        for state in self.layers:
            state.index.reserve(chunks)

    # -- writing ---------------------------------------------------------------------
    def append(self, layer: int, k_pre: Tensor, v: Tensor) -> None:
        """New tokens' pre-RoPE keys and values [t, Hkv, D]; whole pages past the window are sealed."""
        state = self.layers[layer]
        room = max(0, self.config.sink_tokens - state.sink_k.shape[0])
        if room:
            state.sink_k = torch.cat([state.sink_k, k_pre[:room]])
            state.sink_v = torch.cat([state.sink_v, v[:room]])
        if state.basis.basis is None:
            state.basis.add(k_pre)
        state.win_k.push(k_pre[room:])
        state.win_v.push(v[room:])
        state.length += k_pre.shape[0]
        self._seal(layer)

    def fit(self, layer: int, rank: int) -> None:
        """Fix the layer's key basis from the keys so far (sinks and window included), then seal."""
        state = self.layers[layer]
        if state.basis.basis is None:
            state.basis.fit(rank, rotate=self.layout.codec is not None)
            self._seal(layer)

    def _seal(self, layer: int) -> None:
        state, P = self.layers[layer], self.layout.tokens
        if state.basis.basis is None:
            return
        n_pages = (len(state.win_k) - self.config.window_tokens) // P
        if n_pages <= 0:
            return
        start = self.sealed(layer)
        k_pre, v = state.win_k.pop(n_pages * P), state.win_v.pop(n_pages * P)
        positions = torch.arange(start, start + n_pages * P)
        frame = k_pre if self.rotate is None else self.rotate(k_pre, positions)
        state.index.add(frame, k_pre, v, self._outlier_target(state.index.chunks + n_pages * P // self.config.chunk_tokens))
        factors = project(k_pre, state.basis.basis)
        first = len(state.pages)
        keys = self.page_key_run(layer, first, n_pages)
        raws = self.layout.pack(v.reshape(n_pages, P, *v.shape[1:]), factors.reshape(n_pages, P, -1))   # [n, bytes]
        self.manager.put_many(keys, raws, layer=layer, first_index=first, persist=self.persist)
        state.pages.extend(keys)

    def _outlier_target(self, chunks: int) -> int:
        cap = self.config.max_outlier_tokens // self.config.chunk_tokens
        return min(cap, int(self.config.outlier_fraction * chunks))

    def page_key_run(self, layer: int, first: int, count: int) -> list[BlockKey]:
        """The keys of ``layer``'s pages first .. first + count - 1: H(root | "page" | layer | page)."""
        return BlockKey.series(self.root.digest, "page", layer, first=first, count=count)

    # -- reading -------------------------------------------------------------------------
    def chunk_pages(self, chunks: Tensor) -> Tensor:
        """The pages holding ``chunks``: ascending, each once."""
        return torch.from_numpy(page_set(chunks.numpy() // (self.layout.tokens // self.config.chunk_tokens)))

    def page_chunks(self, layer: int, chunks: Tensor) -> Tensor:
        """Every indexed chunk (outliers aside) of the pages that hold ``chunks`` [Hkv, k]: [m],
        ascending. A read brings whole pages with every head's values and key factors, so any of
        these costs attention compute, not a read::

            page p  = chunks [p*P/c, (p+1)*P/c)        read when any head selected one of them
        """
        per = self.layout.tokens // self.config.chunk_tokens
        ids = (page_set(chunks.numpy() // per)[:, None] * per + np.arange(per)).reshape(-1)
        return torch.from_numpy(ids[self.layers[layer].index.candidates.numpy()[ids]])

    def gather(self, layer: int, chunks: Tensor, *, shared: bool = False,
               margins: tuple[int, int] = (0, 0)) -> tuple[Tensor, Tensor, Tensor]:
        """Chunks [Hkv, k] plus the outliers -> pre-RoPE K, V [Hkv, M, D] and their token positions
        [Hkv, M], in token order per head; ``shared``: every head has the same chunks (keys rebuilt in
        one product). K and V keep the pages' dtype (no float32 copy of what is only moved; keys
        rebuilt through a basis, or decoded from quantized pages, are float32). ``margins`` (before,
        after): K and V are [Hkv, before + M + after, D], the gathered rows between rows left for the
        caller to fill (a layer's sinks, its window), so that nothing is copied twice."""
        return self._gather(layer, chunks, shared=shared, split=False, margins=margins)[:3]

    def gather_split(self, layer: int, chunks: Tensor, *, shared: bool = False,
                     margins: tuple[int, int] = (0, 0)) -> tuple[Tensor, Tensor, Tensor, Loading | None]:
        """``gather`` that returns as soon as the pages in place are copied: the rows of pages still
        loading are zeros, and the ``Loading`` fills them in (None: nothing was missing). The
        caller attends to the rest meanwhile (see ``SparseEngine``)."""
        return self._gather(layer, chunks, shared=shared, split=True, margins=margins)

    def _gather(self, layer: int, chunks: Tensor, *, shared: bool, split: bool,
                margins: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, Loading | None]:
        """Each chunk's tokens are taken from the pages straight into their rows of K and V
        (``tierkv.sparse.order``), and the outliers written into theirs."""
        state, (before, after) = self.layers[layer], margins
        H, D, c = self.layout.num_kv_heads, self.layout.head_dim, self.config.chunk_tokens
        ids, k_out, v_out = state.index.exact()
        chunks, outliers, heads = ascending(chunks.numpy()), ids.numpy(), np.arange(H)[:, None]
        at, at_out = merge_slots(chunks, outliers)               # [Hkv, k], [Hkv, m]: slots in token order
        merged = np.empty((H, at.shape[1] + len(outliers)), dtype=np.int64)
        merged[heads, at], merged[heads, at_out] = chunks, outliers
        pos = torch.from_numpy(self.config.sink_tokens + token_rows(merged, c))      # token positions
        M = pos.shape[1]
        read = None
        if chunks.size:
            pages, page = page_slots(chunks // (self.layout.tokens // c))
            self._count(state, pages)
            place = Placed(chunks, page, at, (before, M), before + M + after, c, self.layout.tokens)
            read = self.reader.read(state, layer, pages, place, tier=self.read_tier, shared=shared, split=split)
            k, v = read.k, read.v
        else:
            dtype = k_out.dtype if ids.numel() else self.layout.dtype
            k, v = (torch.empty(H, before + M + after, D, dtype=dtype) for _ in range(2))
        try:
            if ids.numel():             # written whole chunks at a time: rows [c*D] of a view of the buffer
                k, v = joinable(k, k_out).contiguous(), joinable(v, v_out).contiguous()   # (a decoded take may not be)
                for x, exact in zip((k, v), state.index.exact_by_head()):
                    put_rows(x[:, before:before + M].view(H, M // c, c * D), (heads, at_out), exact)
            self.stats.tokens += M
            if read is None or read.future is None:
                return k, v, pos, None
            rows = np.full((H, M), -1)                                           # outliers: -1
            rows[heads, read.place.at() - before] = read.place.rows()
            return k, v, pos, self.reader.loading(state, read, torch.from_numpy(rows))
        except BaseException:
            if read is not None and read.future is not None:    # what is loading is let go of as it arrives
                read.future.cancel()
            raise

    def _count(self, state: LayerState, pages: np.ndarray) -> None:
        self.stats.steps += 1
        self.stats.pages += len(pages)
        read = np.zeros(len(state.pages), dtype=bool)                  # a mark per page (no sort)
        read[pages] = True
        self.stats.reused += int(read[state.previous].sum())
        state.previous = pages

    def prefetch(self, layer: int, chunks: Tensor) -> None:
        """Start loading the pages of ``chunks``, a guess at ``layer``'s selection: they enter the
        tier cold. None when they exceed one gather group (half the tier): the layer would read in
        groups, and each group's loads would evict the cold pages of the next."""
        keys = self.page_keys(layer, chunks)
        if keys and len(keys) <= self.manager.pin_group(self.read_tier):
            self.manager.prefetch(keys, self.read_tier, layer=layer, guess=True)

    def page_keys(self, layer: int, chunks: Tensor) -> list[BlockKey]:
        """The keys of the stored pages that hold ``chunks`` [Hkv, k] of ``layer``."""
        pages = self.layers[layer].pages
        return [pages[p] for p in self.chunk_pages(chunks).tolist() if p < len(pages)]

    def memory_bytes(self) -> int:
        """Bytes this sequence holds outside the tiers: sinks, windows, bases, chunk indexes."""
        total = 0
        for state in self.layers:
            total += state.sink_k.nbytes + state.sink_v.nbytes + state.index.memory_bytes()
            total += sum(f.data.numel() * f.data.element_size() for f in (state.win_k, state.win_v))
            total += state.basis.gram.nbytes + (0 if state.basis.basis is None else state.basis.basis.nbytes)
        return total

    # -- end of life ----------------------------------------------------------------------
    def all_pages(self) -> list[BlockKey]:
        return [key for state in self.layers for key in state.pages]

    def release(self, *, keep: bool) -> None:
        """Keep the pages keyed for reuse as cache (unprotected), or drop them everywhere; the pages under
        private roots are dropped either way (a branch's own: stored, they would only fill the store)."""
        if not keep:
            self.manager.drop(self.all_pages())
            return
        shared = self._shared_counts()
        self.manager.unprotect([key for n, state in zip(shared, self.layers) for key in state.pages[:n]])
        self.manager.drop([key for n, state in zip(shared, self.layers) for key in state.pages[n:]])


def joinable(x: Tensor, *parts: Tensor) -> Tensor:
    """``x`` in the dtype that joining ``parts`` to it gives (float32 outliers widen bf16 page rows)."""
    dtype = functools.reduce(torch.promote_types, (part.dtype for part in parts), x.dtype)
    return x if dtype == x.dtype else x.to(dtype)
