"""Link statistics of a run: bytes, transfers and busy time per tier link and per device.

``busy_s`` adds each transfer's start-to-done time; ``union_s`` counts the
time at least one ran (overlaps once), which is what a link's achieved rate
divides by. A recorded access trace keeps these in ``meta.info`` ("links",
"devices"); the replay prices a tier model from them (`TierModel.from_run`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tierkv.events import Event, busy_seconds

TRANSFER_KINDS = ("put", "load", "prefetch", "demote", "writeback")


def link_bytes(events: Iterable[Event]) -> dict[str, int]:
    """Bytes moved per link ``src->dst`` (``new`` for blocks put by the caller), completed transfers only."""
    moved: dict[str, int] = {}
    for e in _transfers(events):
        link = f"{e.src or 'new'}->{e.dst}"
        moved[link] = moved.get(link, 0) + e.nbytes
    return dict(sorted(moved.items()))


def link_stats(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    """How each link ``src->dst`` did in a run (see `transfer_stats`)."""
    groups: dict[str, list[Event]] = {}
    for e in _transfers(events):
        groups.setdefault(f"{e.src or 'new'}->{e.dst}", []).append(e)
    return {name: transfer_stats(es) for name, es in sorted(groups.items())}


def device_stats(events: Iterable[Event], devices: Sequence[str]) -> dict[str, dict[str, float]]:
    """How each device tier did in a run, reads and writes together: one device serves both."""
    moves = _transfers(events)
    return {d: transfer_stats([e for e in moves if d in (e.src, e.dst)]) for d in devices}


def transfer_stats(transfers: Sequence[Event]) -> dict[str, float]:
    """Transfers, blocks, bytes; ``busy_s`` sums each one's start-to-done time, ``union_s`` counts time
    when at least one ran (overlaps once); ``queued_s`` is the median wait from submit to start."""
    return {"transfers": len(transfers), "blocks": sum(e.blocks for e in transfers),
            "bytes": sum(e.nbytes for e in transfers), "busy_s": sum(e.done - e.start for e in transfers),
            "union_s": busy_seconds([(e.start, e.done) for e in transfers]),
            "queued_s": float(np.median([e.start - e.submit for e in transfers])) if transfers else 0.0}


def _transfers(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.kind in TRANSFER_KINDS and not e.error]
