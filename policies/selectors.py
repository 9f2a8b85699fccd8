"""Chunk selectors and sparse prefetchers for sparse decode, chosen by name.

A selector picks, per KV head, the chunks of a layer's stored keys that a
query attends to; a sparse prefetcher picks which chunks of the next layer to
start loading while the current layer computes (see ``tierkv.policy``)::

    selector     scores each chunk by                                     keeps
    shadowkv     max over the group of q . landmark (mean key, ShadowKV)  landmarks
    quest        upper bound of q . k from per-dim min/max keys (Quest)   lo, hi
    near-memory  as shadowkv, scored at a CXL pool's processor             landmarks
                 (`tierkv.tiers.cxl_select`)

    prefetch       loads for layer l+1, while layer l computes
    none           nothing: every chunk is fetched when its layer asks
    speculative    the chunks layer l+1 would pick for a query guessed from layer l's
                   input (InfiniGen): the real selection then finds most of them arriving;
                   a layer whose guesses held under half of its choices is skipped
    previous-step  the chunks layer l+1 picked in the previous step (ShadowKV's reuse)

``make_selector("shadowkv")`` / ``make_sparse_prefetch("speculative")`` build
one; ``selectors()`` / ``sparse_prefetchers()`` list the names;
``module:Class`` loads a custom one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from policies.registry import Registry
from tierkv.policy import ChunkSelector, ChunkView, SparsePrefetch
from tierkv.scoring import bound_scores, landmark_scores, scores_every_chunk, top_chunks, top_landmark_chunks

SELECTORS: Registry[ChunkSelector] = Registry("selector", ChunkSelector, ("select",))
SPARSE_PREFETCH: Registry[SparsePrefetch] = Registry("sparse_prefetch", SparsePrefetch, ("plan",))
register_selector, selectors, make_selector = SELECTORS.register, SELECTORS.names, SELECTORS.make
register_sparse_prefetch = SPARSE_PREFETCH.register
# Runs at the CXL pool's processor: a capability of that tier, named here by path.
SELECTORS.alias("near-memory", "tierkv.tiers.cxl_select:NearMemorySelector")
sparse_prefetchers, make_sparse_prefetch = SPARSE_PREFETCH.names, SPARSE_PREFETCH.make


@register_selector("shadowkv")
@dataclass(slots=True)
class Landmarks:
    needs: frozenset[str] = frozenset({"landmarks"})

    def select(self, query: Tensor, view: ChunkView, k: int) -> Tensor:
        return top_landmark_chunks(query, view.landmarks, k, view.candidates, scale=view.landmark_scale,
                                   norm=getattr(view, "landmark_norm", None))

    def select_scored(self, query: Tensor, view: ChunkView, k: int) -> tuple[Tensor, Tensor | None]:
        if not scores_every_chunk(view.landmarks, k, scale=view.landmark_scale,
                                  norm=getattr(view, "landmark_norm", None)):
            return self.select(query, view, k), None
        scores = landmark_scores(query, view.landmarks, view.landmark_scale)
        return top_chunks(scores, k, view.candidates), scores


@register_selector("quest")
@dataclass(slots=True)
class PageBounds:
    needs: frozenset[str] = frozenset({"bounds"})

    def select(self, query: Tensor, view: ChunkView, k: int) -> Tensor:
        return top_chunks(bound_scores(query, view.lo, view.hi), k, view.candidates)


@register_sparse_prefetch("none")
@dataclass(slots=True)
class NoSparsePrefetch:
    speculates: bool = False

    def plan(self, layer: int, guess: Tensor | None, previous: Tensor | None) -> Tensor | None:
        return None


@register_sparse_prefetch("speculative")
@dataclass(slots=True)
class Speculative:
    """The guess, for layers whose guesses have been paying off.

    At each plan the layer's previous guess is scored against what the layer then really chose
    (``previous``): the share of chosen chunks the guess held, a moving average per layer. A layer
    below ``min_recall`` is not prefetched (its guess is still made and scored, so it comes back
    when it improves): on SmolLM2 at 128K layers 1-2 guessed 14-31 % of their chunks, and every
    wrong page is a disk read taken from the layers that guess well.
    """
    speculates: bool = True
    min_recall: float = 0.5
    _guesses: dict[int, Tensor] = field(default_factory=dict, init=False, repr=False)
    recall: dict[int, float] = field(default_factory=dict, init=False)   # layer -> moving average

    def plan(self, layer: int, guess: Tensor | None, previous: Tensor | None) -> Tensor | None:
        last = self._guesses.get(layer)
        if last is not None and previous is not None and previous.numel() and last.shape[0] == previous.shape[0]:
            hit = float((previous.unsqueeze(-1) == last.unsqueeze(-2)).any(-1).float().mean())   # per head
            self.recall[layer] = hit if layer not in self.recall else (self.recall[layer] + hit) / 2
        if guess is not None:
            self._guesses[layer] = guess
        return guess if self.recall.get(layer, 1.0) >= self.min_recall else None


@register_sparse_prefetch("previous-step")
@dataclass(slots=True)
class PreviousStepChunks:
    speculates: bool = False

    def plan(self, layer: int, guess: Tensor | None, previous: Tensor | None) -> Tensor | None:
        return previous

