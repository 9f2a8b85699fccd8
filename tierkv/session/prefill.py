"""The state of a token prefix: found stored, resumed from a checkpoint, or prefilled (and stored).

Dense: blocks are content addresses, so a prefill finds every whole block some earlier
run or sequence stored and computes the rest (``Engine.prefill``).

Sparse: the index of a prefix is a file on the shelf of its identity (``tierkv.sparse.store``)
named by the tokens it covers. ``sparse_state(ids)`` takes the longest stored prefix of
``ids``, or a checkpoint of an earlier, stopped prefill of exactly ``ids``, and computes
what is left::

    stored        [ids[:n] ...............]                   loaded, not recomputed
    left          [ids[:n] ...............][ids[n:] ....]     prefilled from the stored state on;
                                                              stored again as ids when store=True

A long prefill saves a checkpoint every ``checkpoint_every`` seconds, so a stopped one
resumes there. A state is never changed in place once stored: what goes past it is
computed in a branch whose pages are its own.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.model.sparse_engine import SparseEngine
from tierkv.session.state import Progress, SparseState
from tierkv.sparse.sequence import SparseSequence
from tierkv.sparse.store import Shelf, identity_key, load_index, save_index

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Opened:
    state: SparseState
    reused: int                # tokens found stored (not computed here)
    resumed: int = 0           # tokens a stopped prefill had checkpointed


def shelf_of(engine: SparseEngine, nvme_dir: Path | None) -> Shelf | None:
    if nvme_dir is None:
        return None
    identity = identity_key(engine.loaded.model_id, engine.layout, engine.config, engine.needs)
    return Shelf(Path(nvme_dir) / "sparse-indexes", identity)


def sparse_state(engine: SparseEngine, ids: Sequence[int], shelf: Shelf | None, *, reuse: bool = True,
                 store: bool = True, checkpoint_every: float = 300.0,
                 progress: Progress | None = None) -> Opened:
    """The state covering ``ids`` (see the module notes); ``store``: save it on the shelf when it
    was computed here."""
    progress = progress or (lambda n: None)
    found = shelf.longest(ids, at_most=len(ids)) if shelf is not None and reuse else 0
    if found:
        state = _load(engine, shelf, ids[:found])
        if state is not None:
            progress(found)
            if found == len(ids):
                return Opened(state, found)
            state.seq.detach()                       # the stored state stays as it was stored
            state.absorb(ids[found:], progress)
            return Opened(state, found)
    return _prefill(engine, ids, shelf if store else None, reuse=reuse, checkpoint_every=checkpoint_every,
                    progress=progress)


def _load(engine: SparseEngine, shelf: Shelf, ids: Sequence[int]) -> SparseState | None:
    seq = engine.new_sequence(len(ids), root=shelf.key(ids), persist=False)
    meta = load_index(seq, shelf.path(ids))
    if meta is None:
        return None
    seq.prefill_s = float(meta.get("prefill_s", 0.0))
    return SparseState(engine, seq, ids)


def _prefill(engine: SparseEngine, ids: Sequence[int], shelf: Shelf | None, *, reuse: bool,
             checkpoint_every: float, progress: Progress) -> Opened:
    seq = engine.new_sequence(len(ids), root=None if shelf is None else shelf.key(ids), persist=shelf is not None)
    if shelf is None:
        engine.prefill(seq, ids, progress)
        return Opened(SparseState(engine, seq, ids), 0)
    partial = shelf.checkpoint(ids)
    if reuse and (meta := load_index(seq, partial)) is not None:
        seq.resumed_tokens, seq.prefill_s = seq.length(0), float(meta.get("prefill_s", 0.0))
        progress(seq.resumed_tokens)
    checkpoints = _Checkpoints(engine, partial, seq.prefill_s, checkpoint_every)
    engine.prefill(seq, ids, progress, checkpoints if checkpoint_every else None)
    engine.manager.flush()
    seq.prefill_s = checkpoints.total_s()
    save_index(seq, shelf.path(ids), prefill_s=seq.prefill_s)
    partial.unlink(missing_ok=True)
    seq.persist = False          # pages sealed after this are not part of the stored state
    return Opened(SparseState(engine, seq, ids), 0, seq.resumed_tokens)


class _Checkpoints:
    """Saves a long prefill's state every ``every_s`` seconds, so a stopped run resumes there."""

    def __init__(self, engine: SparseEngine, path: Path, earlier_s: float, every_s: float) -> None:
        self.engine, self.path, self.earlier_s, self.every_s = engine, path, earlier_s, every_s
        self.start = self.last = time.perf_counter()

    def total_s(self) -> float:
        return self.earlier_s + time.perf_counter() - self.start

    def __call__(self, seq: SparseSequence) -> None:
        if time.perf_counter() - self.last < self.every_s:
            return
        self.engine.manager.flush()              # every page the checkpoint names is stored first
        save_index(seq, self.path, prefill_s=self.total_s(), point="checkpoint")
        self.last = time.perf_counter()
