"""Repairs of a stored document's pages: a page lost or damaged costs a stretch of prefill, not the run.

A sparse state's first pages are those of the stored document it came from
(``SparseSequence.origin``). When a read meets one that is missing or fails its checksum, the
repair first scrubs the document's other pages (reads each stored copy once and checks it: a
bad sector seldom comes alone, and one replay can then seal them all again), takes the last
restore point before the first damaged page (``tierkv.sparse.restore``; none: the start) and
runs the document's prefill again from there, in a twin sequence whose pages have the same
names, until the last damaged page is sealed again::

    document   [...... restore point c ....... damaged p .. damaged q ......]
    replayed                        [c ........................ q sealed]
    the twin   dropped; the state reads its pages as before

The replay runs the same chunks from the same state, so a page it writes is the page the
first prefill wrote. A replay that meets a damaged page before ``c`` (the scrub missed it:
it was damaged since) starts again from an earlier point. Only the document's own pages can
be repaired: pages a conversation sealed after it are not stored anywhere else.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tierkv.errors import BlockMissing, PassBroken
from tierkv.keys import BlockKey
from tierkv.model.sparse_engine import SparseEngine
from tierkv.sparse.restore import Origin, restore_pages, restore_points, restore_prefix, restored
from tierkv.sparse.store import place_file
from tierkv.sparse.sequence import SparseSequence

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Repair:
    pages: int          # damaged pages sealed again
    scrubbed: int       # pages of the document checked
    scrub_s: float      # seconds the check took
    start: int          # the token the replay started from (a restore point, or 0)
    tokens: int         # document tokens replayed
    seconds: float

    def __str__(self) -> str:
        return (f"{self.pages} lost or damaged page(s) computed again: {self.tokens} tokens replayed from token "
                f"{self.start} in {self.seconds:.1f} s ({self.scrubbed} pages checked in {self.scrub_s:.1f} s)")


def repairing(engine: SparseEngine, seq: SparseSequence, work: Callable[[], T]) -> T:
    """``work()``; a page it cannot read is repaired and ``work`` runs again (it must leave ``seq``
    as it found it when it fails, as the engine's passes do, or raise PassBroken: then the repair
    is made for the next request and the error raised), as long as each repair is of new pages."""
    seen: set[BlockKey] = set()
    while True:
        try:
            return work()
        except BlockMissing as error:
            keys = set(error.keys)
            if not keys or keys <= seen or seq.origin is None:
                raise
            seen |= keys
            repair(engine, seq, keys, cause=error)
            if isinstance(error, PassBroken):
                raise                     # repaired for the next request; this sequence cannot go on


def repair(engine: SparseEngine, seq: SparseSequence, keys: Iterable[BlockKey], *,
           cause: BlockMissing | None = None) -> Repair:
    """Seal ``keys`` (pages of ``seq``'s stored document) again, with every other damaged page of the
    document that a scrub finds (the first repair of a document scrubs it); raises ``cause`` (or
    BlockMissing) when a key is not such a page."""
    origin, begin = seq.origin, time.perf_counter()
    place = _places(seq, origin) if origin is not None else {}
    keys = set(keys)
    if not keys or not keys <= place.keys():
        raise cause or BlockMissing("pages that are not of a stored document cannot be computed again",
                                    tuple(keys - place.keys()))
    scrub = not origin.repairs                    # once per document: a page damaged since is met on its own
    scrubbed = len(place) if scrub else 0
    if scrub:
        keys |= set(engine.manager.scrub(sorted(place, key=place.get)))
    scrub_s = time.perf_counter() - begin
    damaged = {key: place[key] for key in keys}
    log.warning("%d lost or damaged page(s) of a stored document; computing them again", len(damaged))
    while True:
        try:
            start = _replay(engine, seq, origin, damaged)
            break
        except BlockMissing as error:
            more = set(error.keys) - damaged.keys()
            if not more or not more <= place.keys():
                raise
            damaged |= {key: place[key] for key in more}
    repaired = Repair(len(damaged), scrubbed, scrub_s, start,
                      min(_until(seq, damaged.values()), len(origin.tokens)) - start,
                      time.perf_counter() - begin)
    origin.repairs.append(repaired)
    log.warning("repaired %s", repaired)
    return repaired


def _fetched(remote, path: Path) -> bool:
    """A restore point the remote store keeps, brought to ``path`` (its checks run as it is read)."""
    payload = remote.get_file(path.name)
    if payload is not None:
        place_file(path, payload)
    return payload is not None


def _places(seq: SparseSequence, origin: Origin) -> dict[BlockKey, tuple[int, int]]:
    """(layer, page) of each page of the stored document."""
    return {key: (layer, page) for layer, state in enumerate(seq.layers)
            for page, key in enumerate(state.pages[:origin.pages[layer]])}


def _until(seq: SparseSequence, places: Iterable[tuple[int, int]]) -> int:
    """The tokens a prefill has run when every page at ``places`` is sealed: the window past it full,
    and the exact part of the prefill over (no page is sealed before the key basis is fit at its end,
    or at the end of a document that lies within it)."""
    c, P = seq.config, seq.layout.tokens
    return max(c.dense_prefill_tokens or 0, *(c.sink_tokens + (page + 1) * P + c.window_tokens for _, page in places))


def _replay(engine: SparseEngine, seq: SparseSequence, origin: Origin,
            damaged: dict[BlockKey, tuple[int, int]]) -> int:
    """Run the document's prefill from the last restore point before every damaged page until each is
    sealed again; the token it started from."""
    first = [min((p for (layer, p) in damaged.values() if layer == i), default=len(state.pages))
             for i, state in enumerate(seq.layers)]
    twin = engine.new_sequence(len(origin.tokens), root=origin.root, persist=True)
    start, remote = 0, engine.manager.remote
    shared = [] if remote is None else remote.file_names(prefix=restore_prefix(origin.path))
    sealing = min(_until(seq, [place]) for place in damaged.values())     # no point before it holds one
    for token, path in reversed(restore_points(origin.path, elsewhere=shared)):
        if token >= sealing or (not path.exists() and not _fetched(remote, path)):
            continue
        pages = restore_pages(path)
        if pages is not None and all(p <= f for p, f in zip(pages, first)) and restored(seq, path, twin):
            start = token
            break
    before = [len(state.pages) for state in twin.layers]
    try:
        engine.prefill(twin, origin.tokens, until=_until(seq, damaged.values()))
        engine.manager.flush()
    finally:   # the twin's puts hold what they wrote: a damaged page's hold is now the state's, and a
        # page that was still stored got one more, which goes
        sealed = [key for state, n in zip(twin.layers, before) for key in state.pages[n:]]
        engine.manager.unprotect([key for key in sealed if key not in damaged])
    lost = [key for key, (layer, page) in damaged.items()
            if page >= len(twin.layers[layer].pages) or twin.layers[layer].pages[page] != key]
    if lost:
        raise BlockMissing(f"{len(lost)} lost or damaged page(s) were not sealed again by a replay of the document "
                           f"from token {start}", tuple(lost))
    return start
