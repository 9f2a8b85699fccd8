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
resumes there, and a restore point every ``restore.spacing(tokens)`` tokens, from which a
page found damaged later is computed again (``tierkv.session.repair``). A state is never
changed in place once stored: what goes past it is computed in a branch whose pages are
its own.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import BlockMissing, TierKVError
from tierkv.keys import BlockKey
from tierkv.model.sparse_engine import SparseEngine
from tierkv.session.repair import repair
from tierkv.session.state import Progress, Seed, SparseState
from tierkv.sparse.restore import Origin, restore_path, restore_points, save_restore, spacing
from tierkv.sparse.sequence import SparseSequence
from tierkv.sparse.store import Shelf, identity_key, load_index, place_file, save_index

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Opened:
    state: SparseState
    reused: int                # tokens found stored (not computed here)
    resumed: int = 0           # tokens a stopped prefill had checkpointed


def shelf_of(engine: SparseEngine, nvme_dir: Path | None) -> Shelf | None:
    if nvme_dir is None:
        return None
    identity = identity_key(engine.kv_of, engine.layout, engine.config, engine.needs)
    return Shelf(Path(nvme_dir) / "sparse-indexes", identity)


def sparse_state(engine: SparseEngine, ids: Sequence[int], shelf: Shelf | None, *, reuse: bool = True,
                 store: bool = True, checkpoint_every: float = 300.0,
                 progress: Progress | None = None, seed: Seed | None = None) -> Opened:
    """The state covering ``ids`` (see the module notes); ``store``: save it on the shelf when it
    was computed here; ``seed``: KV of its first tokens a dense state computed, taken where nothing
    is found stored (read, not computed again)."""
    progress = progress or (lambda n: None)
    if shelf is not None and store:
        shelf.check(ids)
    found = shelf.longest(ids, at_most=len(ids)) if shelf is not None and reuse else 0
    if shelf is not None and reuse and found < len(ids) and fetch_index(engine, shelf, ids, longer_than=found):
        found = shelf.longest(ids, at_most=len(ids))
    if shelf is not None and reuse and found < len(ids):
        _name_other_spelling(engine, shelf, ids, found)
    if found:
        state = stored_state(engine, shelf, ids[:found])
        if state is not None:
            progress(found)
            if found == len(ids):
                return Opened(state, found)
            try:
                state.absorb(ids[found:], progress)
            except BaseException:
                state.release()
                raise
            return Opened(state, found)
    return _prefill(engine, ids, shelf if store else None, reuse=reuse, checkpoint_every=checkpoint_every,
                    progress=progress, seed=seed)


_NAMED: set[tuple] = set()       # the stored documents a warning named already


def _name_other_spelling(engine: SparseEngine, shelf: Shelf, ids: Sequence[int], found: int) -> None:
    """Where the document is stored further under another spelling of the same page format (``int4`` and
    ``int4-g64`` name indexes of their own, whose pages' keys derive from them), say so: a prefill of
    hours may be one flag away from a read."""
    spec, best, covered = engine.loaded.spec, None, found
    try:
        for other in engine.config.spellings(spec.head_dim, str(spec.dtype).removeprefix("torch.")):
            layout = SparseEngine.page_layout(engine.loaded, other)
            there = Shelf(shelf.directory, identity_key(engine.kv_of, layout, other, engine.needs))
            if (n := there.longest(ids, at_most=len(ids))) > covered:
                best, covered = other, n
    except Exception as error:                 # (a hint: it never stops a prefill)
        log.debug("other spellings of the page format not looked for: %s", error)
    said = (str(shelf.directory), shelf.identity.digest, covered)
    if best is None or said in _NAMED:
        return
    _NAMED.add(said)                          # once a process: a server's every conversation starts with it
    own, flags = engine.config, []
    if best.page_dtype != own.page_dtype:
        flags.append(f"--page-dtype {best.page_dtype}" if best.page_dtype else "no --page-dtype")
    if best.landmark_dtype != own.landmark_dtype:
        flags.append(f"--landmark-dtype {best.landmark_dtype}" if best.landmark_dtype else "no --landmark-dtype")
    log.warning("sparse index: %d tokens of this document are stored under %s (the same format, spelled "
                "otherwise: an index of its own); give that to read them instead of computing them",
                covered, " and ".join(flags))


def stored_state(engine: SparseEngine, shelf: Shelf, ids: Sequence[int]) -> SparseState | None:
    """The stored state of ``ids``, its missing pages computed again; None if the index is not usable
    (or a missing page cannot be rebuilt): the caller prefills."""
    seq, path, missing = engine.new_sequence(len(ids), root=shelf.key(ids), persist=False), shelf.path(ids), []
    meta = load_index(seq, path, missing=missing, ids=ids, identity=shelf.identity)
    if meta is None:
        return None
    seq.prefill_s = float(meta.get("prefill_s", 0.0))
    seq.origin = Origin.of(seq, path, ids)
    if missing:
        try:
            repair(engine, seq, missing)
        except BlockMissing as error:
            log.warning("sparse index %s: %s; prefilling again", path.name, error)
            seq.release(keep=True)
            return None
    seq.detach()                 # pages it seals from now on are its own, not the stored document's
    return SparseState(engine, seq, ids)


def _prefill(engine: SparseEngine, ids: Sequence[int], shelf: Shelf | None, *, reuse: bool,
             checkpoint_every: float, progress: Progress, seed: Seed | None) -> Opened:
    seq = engine.new_sequence(len(ids), root=None if shelf is None else shelf.key(ids), persist=shelf is not None)
    try:
        return _prefill_into(seq, engine, ids, shelf, reuse=reuse, checkpoint_every=checkpoint_every,
                             progress=progress, seed=seed)
    except BaseException:     # what it sealed is let go of, kept in the store where there is one
        seq.release(keep=engine.manager.has_store)
        raise


def _prefill_into(seq: SparseSequence, engine: SparseEngine, ids: Sequence[int], shelf: Shelf | None, *,
                  reuse: bool, checkpoint_every: float, progress: Progress, seed: Seed | None) -> Opened:
    if shelf is None:
        seeded = _seeded(engine, seq, ids, seed, progress)
        engine.prefill(seq, ids, progress)
        return Opened(SparseState(engine, seq, ids), seeded)
    partial = shelf.checkpoint(ids)
    if reuse and (meta := load_index(seq, partial, ids=ids, identity=shelf.identity)) is not None:
        seq.resumed_tokens, seq.prefill_s = seq.length(0), float(meta.get("prefill_s", 0.0))
        progress(seq.resumed_tokens)
    seeded = _seeded(engine, seq, ids, seed, progress)
    path = shelf.path(ids)
    checkpoints = _Checkpoints(engine, partial, path, ids, shelf.identity, seq.prefill_s, checkpoint_every)
    engine.prefill(seq, ids, progress, checkpoints)
    engine.manager.flush()
    seq.prefill_s = checkpoints.total_s()
    save_index(seq, path, prefill_s=seq.prefill_s, ids=ids, identity=shelf.identity)
    share_index(engine, path)
    partial.unlink(missing_ok=True)
    seq.origin = Origin.of(seq, path, ids)
    seq.detach()                 # pages sealed after this are not part of the stored state: keyed apart
    return Opened(SparseState(engine, seq, ids), seeded, seq.resumed_tokens)


def _seeded(engine: SparseEngine, seq: SparseSequence, ids: Sequence[int], seed: Seed | None,
            progress: Progress) -> int:
    """The tokens of ``seed`` the empty ``seq`` takes (``SparseEngine.seed``); none where its KV cannot
    be read (a block lost or damaged, no room to load it): they are computed."""
    if seed is None:
        return 0
    try:
        seeded = engine.seed(seq, min(seed.tokens, len(ids)), seed.kv)
    except TierKVError as error:
        log.warning("the dense KV of the first %d tokens could not be read (%s: %s); computing them", seed.tokens,
                    type(error).__name__, error)
        return 0
    progress(seeded)
    return seeded


def share_index(engine: SparseEngine, path: Path) -> None:
    """Put a stored index in the remote store, then its restore points where the remote takes them (a page
    the remote lost then costs a replay from the point before it, on any machine, not from the start;
    a repair fetches the one it needs). Its pages went there as they were sealed, and the flush before
    the index was saved waited for them."""
    remote = engine.manager.remote
    if remote is not None and remote.put_file(path.name, path.read_bytes()):
        for _, point in restore_points(path):
            remote.put_file(point.name, point.read_bytes())


def fetch_index(engine: SparseEngine, shelf: Shelf, ids: Sequence[int], *, longer_than: int) -> bool:
    """Bring the remote store's index of the longest prefix of ``ids`` (longer than ``longer_than``
    tokens) onto the shelf; whether one came. Its checksums and pages are checked as it loads."""
    remote = engine.manager.remote
    if remote is None:
        return False
    best = None
    for name in remote.file_names(prefix=shelf.identity.hex()[:16] + "-"):
        tokens = shelf.covers(name, ids)
        if tokens is not None and tokens > longer_than and (best is None or tokens > best[0]):
            best = (tokens, name)
    if best is None:
        return False
    payload = remote.get_file(best[1])
    if payload is None:
        return False
    shelf.directory.mkdir(parents=True, exist_ok=True)
    place_file(shelf.directory / best[1], payload)
    log.info("sparse index %s: read from the remote store", best[1])
    return True


class _Checkpoints:
    """Saves a long prefill's state every ``every_s`` seconds (0: never), so a stopped run resumes
    there, and a restore point of it every ``spacing(tokens)`` tokens (``tierkv.sparse.restore``)."""

    def __init__(self, engine: SparseEngine, path: Path, index: Path, ids: Sequence[int], identity: BlockKey,
                 earlier_s: float, every_s: float) -> None:
        self.engine, self.path, self.index, self.earlier_s, self.every_s = engine, path, index, earlier_s, every_s
        self.ids, self.identity = ids, identity
        self.spacing = spacing(len(ids))
        self.next_restore = self.spacing
        self.start = self.last = time.perf_counter()

    def total_s(self) -> float:
        return self.earlier_s + time.perf_counter() - self.start

    def __call__(self, seq: SparseSequence) -> None:
        at = seq.length(0)
        if at >= self.next_restore:
            save_restore(seq, restore_path(self.index, at))
            self.next_restore = (at // self.spacing + 1) * self.spacing
        if not self.every_s or time.perf_counter() - self.last < self.every_s:
            return
        self.engine.manager.flush()              # every page the checkpoint names is stored first
        save_index(seq, self.path, prefill_s=self.total_s(), point="checkpoint", ids=self.ids[:at],
                   identity=self.identity)
        self.last = time.perf_counter()
