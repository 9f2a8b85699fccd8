"""Protocols that strategies in the top-level ``policies`` package implement.

Policies rank, the manager acts: a policy sees only keys, never bytes or
tiers.

Eviction: one ``EvictionPolicy`` instance serves one tier. ``evict(n,
protected)`` returns ``n`` victims, none of them in ``protected``, and
forgets them; when it cannot find ``n`` it returns ``None`` and changes
nothing.

Hints: a strategy may also have any of three optional methods. The manager
calls a hint only on policies whose class has it (``implements``: checked
against the protocols below once per class; a method set to None opts out),
so a policy without hints, and a caller that never sends them, keep working
unchanged::

    insert_cold(key)                 instead of ``insert`` for a block a guessed prefetch loaded:
                                     evict it first unless a reader uses it (``touch``)
    describe(key, *, layer, index)   right after each insert of ``key``: the block holds
                                     block ``index`` (0 = first tokens) of ``layer``;
                                     either may be None (unknown)
    observe(key, score)              attention mass the block just received (summed
                                     over heads and query rows); the policy adds it up
    touch_many(keys)                 ``touch`` each key in order, in one call (a read's
                                     hundreds of blocks; without it, one ``touch`` each)

A hint for a key the policy does not hold is allowed: ``describe`` ignores
it, ``observe`` may remember it for when the block comes back.

Prefetch: one ``PrefetchPolicy`` instance serves one reader (a decode
loop). Before the reader computes layer ``l - 1`` it asks which of layer
``l``'s blocks to start loading::

    plan(layer, blocks, depth) -> keys       blocks: the layer's sealed keys, first token first
                                             depth:  how many blocks fit beside those in use
    selected(layer, indices)                 optional: the block indices a sparse reader
                                             really attended to in ``layer`` this step

Chunk selection (sparse decode): a ``ChunkSelector`` picks, per KV head,
the ``k`` chunks of a layer's indexed keys that a query attends to; it sees
the layer's chunk summaries (``ChunkView``), never the tiers::

    select(query [Hq, D], view, k) -> chunk ids [Hkv, k'] ascending, k' <= k
    needs                              summaries the index must keep ("landmarks", "bounds")

A ``SparsePrefetch`` decides which chunks of the next layer to load while
the current one computes, from a speculative selection (the next layer's
query guessed from this layer's input, InfiniGen-style) and/or the chunks
that layer chose in the previous step::

    plan(layer, guess, previous) -> chunk ids [Hkv, n] or None
"""
from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor


def implements(policy: object, protocol: type) -> bool:
    """``isinstance(policy, protocol)`` for a method-only protocol, decided once per class:
    the check itself walks every member of the protocol, too slow for a per-block hot path."""
    return _implements(type(policy), protocol)


@cache
def _implements(cls: type, protocol: type) -> bool:
    return issubclass(cls, protocol)


@runtime_checkable
class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None:
        """A block became resident in the tier."""

    def touch(self, key: Hashable) -> None:
        """A resident block was used."""

    def remove(self, key: Hashable) -> None:
        """A block left the tier for a reason other than ``evict``."""

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        """Choose and forget ``n`` victims outside ``protected``, or return None."""

    def __len__(self) -> int: ...


@runtime_checkable
class AdmitsCold(Protocol):
    def insert_cold(self, key: Hashable) -> None:
        """A block loaded on a guess (a prefetch) became resident: rank it for early eviction
        until it is used (``touch``), so a wrong guess does not push out blocks in use."""


@runtime_checkable
class InsertsMany(Protocol):
    def insert_many(self, keys: Sequence[Hashable]) -> None:
        """``insert`` each of ``keys``, in order (a reopened store's million blocks)."""


@runtime_checkable
class TouchesMany(Protocol):
    def touch_many(self, keys: Iterable[Hashable]) -> None:
        """``touch`` each of ``keys``, in order."""


@runtime_checkable
class DescribesBlocks(Protocol):
    def describe(self, key: Hashable, *, layer: int | None, index: int | None) -> None:
        """Where the block just inserted sits in its sequence."""


@runtime_checkable
class ObservesScores(Protocol):
    def observe(self, key: Hashable, score: float) -> None:
        """Attention mass the block received in one step."""


@runtime_checkable
class PrefetchPolicy(Protocol):
    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        """Keys among ``blocks`` of ``layer`` to start loading now, most urgent first."""


@runtime_checkable
class ObservesSelection(Protocol):
    def selected(self, layer: int, indices: Sequence[int]) -> None:
        """The block indices of ``layer`` a sparse reader attended to this step."""


class ChunkView(Protocol):
    """One layer's chunk summaries, as a selector sees them (``None``: not kept by this index)."""

    layer: int
    landmarks: Tensor | None     # [C, Hkv, D] mean key per chunk, in the query's RoPE frame
    landmark_scale: Tensor | None  # [C, Hkv] when the landmarks are int8 codes (tierkv.scoring), else None
    landmark_norm: Tensor | None   # [Hkv] no landmark of a head is longer (optional: lets bf16 landmarks be
                                   # scored in bf16 first, tierkv.scoring.top_landmark_chunks)
    lo: Tensor | None            # [C, Hkv, D] per-dimension min key per chunk
    hi: Tensor | None            # [C, Hkv, D] per-dimension max key per chunk
    candidates: Tensor           # [C] bool: chunks that may be chosen (outliers are kept exact instead)


@runtime_checkable
class ChunkSelector(Protocol):
    needs: frozenset[str]

    def select(self, query: Tensor, view: ChunkView, k: int) -> Tensor:
        """Chunk ids [Hkv, k'] (ascending, k' <= k) that ``query`` [Hq, D] should attend to."""


@runtime_checkable
class SharesScores(Protocol):
    def select_scored(self, query: Tensor, view: ChunkView, k: int) -> tuple[Tensor, Tensor | None]:
        """``select``, and the landmark scores [Hkv, C] of every chunk (``tierkv.scoring.landmark_scores``)
        where it computed them all, else None: a step that widens its selection takes them from there."""


@runtime_checkable
class SparsePrefetch(Protocol):
    def plan(self, layer: int, guess: Tensor | None, previous: Tensor | None) -> Tensor | None:
        """Chunk ids of ``layer`` to start loading now, or None for nothing."""
