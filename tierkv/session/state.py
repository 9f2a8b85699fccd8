"""A prefilled token prefix held in the tiers, ready to be extended: the state a session reuses.

A state covers ``tokens`` (a document, a conversation so far). Asking something
of it never changes it: a question is asked of a ``fork``, which shares what the
state holds and keeps what it adds to itself::

    document state  [doc ........................]          held while the session lives
      fork + extend [doc ........................][q1 a1]    released after the answer
      fork + extend [doc ........................][q2 a2]    never sees q1 or a1

``DenseState``: a fork is a branch of the parent's sequence (``TieredSequence.fork``):
it holds the parent's blocks once more and copies its partial last block, so it
recomputes nothing. A state made from tokens alone (a prefix to find stored) finds
every whole block by content and computes the rest.
``SparseState``: a fork shares the parent's pages and index (``SparseSequence.fork``)
and recomputes nothing; its own pages are private to it. A page of the stored document
that turns out lost or damaged is computed again and the step goes on
(``tierkv.session.repair``).

``extend(ids)`` computes ``ids`` after ``tokens`` and returns the logits that follow
them; ``absorb(ids)`` computes them when no logits are needed (a document); ``step``
is one decode step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from tierkv.errors import BlockMissing, TierKVError
from tierkv.model.engine import Engine
from tierkv.model.sequence import TieredSequence
from tierkv.model.sparse_engine import SparseEngine
from tierkv.session.repair import repairing
from tierkv.sparse.sequence import SparseSequence

Progress = Callable[[int], None]      # called with the number of tokens just computed
T = TypeVar("T")


class KVState(Protocol):
    tokens: list[int]
    mode: str
    computed_from: int     # the first position the last ``extend`` computed (before it: found stored)

    def fork(self) -> KVState: ...

    def absorb(self, ids: Sequence[int], progress: Progress | None = None) -> None: ...

    def extend(self, ids: Sequence[int], progress: Progress | None = None) -> Tensor: ...

    def step(self, token: int) -> Tensor: ...

    def verify(self, ids: Sequence[int]) -> Tensor: ...       # extend, with the logits after each token

    def crop(self, tokens: int) -> None: ...                  # forget the last tokens

    def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Seed:
    """KV a dense state computed of a prompt's first ``tokens`` tokens: a sparse state of the prompt
    starts from it instead of computing them again (``SparseEngine.seed``)."""

    tokens: int
    kv: Callable[[int], tuple[Tensor, Tensor]]     # layer -> post-RoPE K and V [1, Hkv, >= tokens, D]


class _Releasable:
    """A state's KV is gone once released: using it then raises, where it would attend to nothing."""
    released = False

    def _check_held(self) -> None:
        if self.released:
            raise TierKVError(f"this {self.mode} state was released: its KV is gone")


class DenseState(_Releasable):
    mode = "dense"

    def __init__(self, engine: Engine, *, pending: Sequence[int] = (), seq: TieredSequence | None = None) -> None:
        """``pending``: tokens the state covers but has not computed yet: the first extension finds
        their whole blocks by content and recomputes the rest. ``seq``: a sequence it takes over."""
        self.engine = engine
        self.seq: TieredSequence = seq if seq is not None else engine.new_sequence()
        self.pending = list(pending)
        self.reused = 0                    # tokens of the last extension found stored
        self.computed_from = 0             # the first position the last extension computed

    @property
    def tokens(self) -> list[int]:
        return self.seq.token_ids + self.pending

    def fork(self) -> DenseState:
        self._check_held()
        if not self.pending and self.seq.token_ids:
            try:
                return DenseState(self.engine, seq=self.seq.fork())
            except BlockMissing:                          # a block lost: found by content, the rest computed
                pass
        return DenseState(self.engine, pending=self.tokens)     # (and one with nothing computed yet)

    def absorb(self, ids: Sequence[int], progress: Progress | None = None) -> None:
        self.extend(ids, progress)

    def seed(self, ids: Sequence[int]) -> Seed | None:
        """The KV this state computed of the longest prefix of ``ids`` it shares, for a sparse state of
        ``ids`` to start from; None where it shares none, or its blocks hold the KV quantized."""
        if self.released or self.engine.layout.codec is not None:
            return None
        tokens = shared_prefix(self.seq.token_ids, ids)
        return Seed(tokens, self.seq.read) if tokens else None

    def extend(self, ids: Sequence[int], progress: Progress | None = None) -> Tensor:
        self._check_held()
        if not ids:
            raise ValueError("nothing to extend the state with")
        if not self.seq.token_ids:                     # reuse whatever the store holds of the prefix
            everything = [*self.pending, *ids]
            logits, self.reused = self.engine.prefill(self.seq, everything, progress)
            self.pending, self.computed_from = [], self.reused
            return logits
        self.reused = 0
        logits, self.computed_from = self.engine.extend(self.seq, ids, progress)
        return logits

    def step(self, token: int) -> Tensor:
        self._check_held()
        if self.pending:                               # (a crop fell back to its tokens: computed first)
            return self.extend([token])
        return self.engine.decode(self.seq, token)

    def verify(self, ids: Sequence[int]) -> Tensor:
        """Compute ``ids`` in one pass; the logits after each of them [len(ids), vocab]."""
        self._check_held()
        if self.pending:
            self.engine.prefill(self.seq, self.pending)
            self.pending = []
        return self.engine.extend(self.seq, ids, every=True)[0]

    def crop(self, tokens: int) -> None:
        pending = min(tokens, len(self.pending))       # (tokens not computed yet go first: they are the newest)
        del self.pending[len(self.pending) - pending:]
        if tokens <= pending:
            return
        kept = self.tokens[:len(self.tokens) - (tokens - pending)]
        try:
            self.seq.crop(tokens - pending)            # (a crop into a sealed block reads it)
        except BlockMissing:                           # lost or damaged: found by content, the rest computed
            self.seq.release(keep=True)
            self.seq, self.pending = self.engine.new_sequence(), kept

    def release(self) -> None:
        self.released = True
        self.seq.release(keep=self.engine.manager.has_store and self.engine.config.reuse)


class SparseState(_Releasable):
    mode = "sparse"

    def __init__(self, engine: SparseEngine, seq: SparseSequence, tokens: Sequence[int]) -> None:
        self.engine, self.seq, self.tokens = engine, seq, list(tokens)
        self.computed_from = 0             # the first position the last extension computed

    def fork(self) -> SparseState:
        self._check_held()
        return SparseState(self.engine, self._repairing(self.seq.fork), self.tokens)

    def absorb(self, ids: Sequence[int], progress: Progress | None = None) -> None:
        self._check_held()
        self.computed_from = len(self.tokens)
        self.tokens += ids
        self._repairing(lambda: self.engine.prefill(self.seq, self.tokens, progress))

    @torch.inference_mode()
    def extend(self, ids: Sequence[int], progress: Progress | None = None) -> Tensor:
        if not ids:
            raise ValueError("nothing to extend the state with")
        self.absorb(ids[:-1], progress)
        logits = self.step(ids[-1])
        if progress:
            progress(1)
        return logits

    def step(self, token: int) -> Tensor:
        self._check_held()
        self.tokens.append(token)
        return self._repairing(lambda: self.engine.decode(self.seq, token))

    def _repairing(self, work: Callable[[], T]) -> T:
        """``work()``, with the stored document's damaged pages computed again (``tierkv.session.repair``)."""
        return repairing(self.engine, self.seq, work)

    def verify(self, ids: Sequence[int]) -> Tensor:
        raise NotImplementedError("drafts are verified in dense mode only: a sparse pass over several tokens "
                                  "selects for all of them at once, so it would not give greedy decoding's tokens")

    def crop(self, tokens: int) -> None:
        self.seq.crop(tokens)
        del self.tokens[len(self.tokens) - tokens:]

    def release(self) -> None:
        self.released = True
        self.seq.release(keep=self.engine.manager.has_store)


def covers(state: KVState, ids: list[int]) -> int:
    """How many tokens of ``ids`` a fork of ``state`` can start from: all of its tokens where they start
    ``ids``; in dense mode, also the tokens it shares with ``ids`` before they differ (the fork crops
    the rest: a stopped answer whose text comes back tokenized otherwise). At least one token of ``ids``
    is left to compute, for its logits."""
    tokens = state.tokens
    if len(tokens) < len(ids) and ids[:len(tokens)] == tokens:
        return len(tokens)
    if state.mode != "dense":    # (cropped, it would keep pages and a key basis the prompt computed afresh lacks)
        return 0
    return shared_prefix(tokens, ids[:len(ids) - 1])


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share before they differ."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def fork_at(state: KVState, tokens: int) -> KVState:
    """A fork of ``state`` that holds its first ``tokens`` tokens."""
    fork = state.fork()
    try:
        if len(fork.tokens) > tokens:
            fork.crop(len(fork.tokens) - tokens)
    except BaseException:
        fork.release()
        raise
    return fork
