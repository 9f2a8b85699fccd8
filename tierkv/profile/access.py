"""Recording an access trace: the tier manager's access hook, step by step.

An `AccessRecorder` is the tier manager's access hook (``manager.access``,
see `tierkv.events.AccessHook`); the engine also tells it where each
prefill chunk or decode step begins (``begin_step``). Blocks get dense ids in
first-seen order. At the end, ``recorder.trace(manager)`` joins what the hook
saw with the manager's events (how long the caller was blocked in each call,
when each layer began) into an `AccessTrace` (`tierkv.profile.access_trace`;
its file: `tierkv.profile.access_file`), which the replay simulator
(`tierkv.tune.replay`) runs without the model.

A call before the first ``begin_step`` belongs to step 0 (an implicit
prefill step is added).

Besides the manager, a prefetcher may tell the recorder what it guesses a
layer will read: ``on_guess(keys, layer, source)`` (the sparse engine does,
for its ``speculative`` guesses, whether or not it prefetches them). A guess
is an op of kind ``guess``; the replay can issue it as a prefetch.
"""
from __future__ import annotations

import math
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tierkv.events import Event, EventKind
from tierkv.keys import BlockKey
from tierkv.profile.access_trace import ARRIVING, NOWHERE, STEP_KINDS, AccessTrace, OpKind, TraceMeta
from tierkv.profile.link_stats import device_stats, link_stats

if TYPE_CHECKING:  # profile sits below the manager: no import at run time
    from tierkv.manager.manager import TierManager


class AccessRecorder:
    """The manager's access hook: records every put and get, step by step, and the guesses it is told.

    Calls come from the manager's loop thread (``on_put``/``on_acquire``) and
    the model's thread (``begin_step``, ``on_guess``), one at a time: each
    append is atomic under the GIL and the caller waits for the manager
    between calls.
    """

    def __init__(self, *, read_tier: str | None = None, clock: Callable[[], float] = time.perf_counter,
                 info: dict[str, Any] | None = None) -> None:
        self.read_tier = read_tier
        self.info = dict(info or {})
        self._clock = clock
        self.origin = clock()
        self._manager: TierManager | None = None
        self._ids: dict[BlockKey, int] = {}
        self._steps = {"kind": array("B"), "tokens": array("I"), "time": array("d")}
        self._ops = {"kind": array("B"), "step": array("I"), "layer": array("i"), "count": array("I"),
                     "time": array("d"), "source": array("B")}
        self._blocks, self._where = array("I"), array("B")
        self._sources: dict[str, int] = {}   # prefetcher -> its index in the trace's meta.sources

    def attach(self, manager: TierManager) -> AccessRecorder:
        """Become ``manager.access`` (a TierManager) and note where each block is when it is used."""
        self._manager = manager
        manager.access = self
        return self

    # -- the hook --------------------------------------------------------------
    def begin_step(self, kind: str, tokens: int) -> None:
        if kind not in STEP_KINDS:
            raise ValueError(f"kind={kind!r}: allowed: {', '.join(STEP_KINDS)}")
        self._add_step(STEP_KINDS.index(kind), tokens)

    def on_put(self, key: BlockKey, layer: int | None) -> None:
        self._add_op(OpKind.PUT, (key,), layer)

    def on_acquire(self, keys: Sequence[BlockKey], layer: int | None) -> None:
        self._add_op(OpKind.GET, keys, layer)

    def on_guess(self, keys: Sequence[BlockKey], layer: int, source: str) -> None:
        """``source`` (a prefetcher, e.g. "speculative") guesses ``layer`` will read ``keys``."""
        if not source:
            raise ValueError("source='': name the prefetcher that made the guess")
        self._add_op(OpKind.GUESS, keys, layer, self._sources.setdefault(source, len(self._sources)))

    # -- the result --------------------------------------------------------------
    def trace(self, manager: TierManager | None = None, events: Iterable[Event] | None = None,
              meta: TraceMeta | None = None) -> AccessTrace:
        """The trace so far. ``manager`` (default: the attached one) supplies the tiers and its events."""
        manager = manager if manager is not None else self._manager
        if meta is None and manager is None:
            raise ValueError("give the manager the trace was recorded on, or its TraceMeta")
        if events is None and manager is not None:
            events = manager.events.events
        events = list(events or ())
        op_time, step_time = np.array(self._ops["time"], np.float64), np.array(self._steps["time"], np.float64)
        layers = max([e.layer + 1 for e in events if e.kind == EventKind.LAYER and e.layer is not None], default=0)
        timed = any(e.kind in (EventKind.WAIT, EventKind.PUT, EventKind.LAYER) for e in events)
        if meta is None:
            meta = TraceMeta.of(manager, read_tier=self.read_tier, layers=layers, timed=timed,
                                info=self.info | {"links": link_stats(events),
                                                  "devices": device_stats(events, self._store_names(manager))})
        if self._sources:
            meta = replace(meta, sources=tuple(self._sources))
        steps, ops = self._steps, self._ops  # copied: the recorder may go on recording
        return AccessTrace(
            meta, np.array(steps["kind"]), np.array(steps["tokens"]), step_time,
            np.array(ops["kind"]), np.array(ops["step"]), np.array(ops["layer"]), np.array(ops["count"]), op_time,
            _blocked(ops["kind"], op_time, events, self.origin),
            np.array(self._blocks), np.array(self._where), _layer_starts(step_time, meta.layers, events, self.origin),
            np.array(ops["source"]))

    def save(self, path: str | Path, manager: TierManager | None = None) -> AccessTrace:
        trace = self.trace(manager)
        trace.write(path)
        return trace

    # -- internals ---------------------------------------------------------------
    def _add_step(self, kind: int, tokens: int) -> None:
        self._steps["kind"].append(kind)
        self._steps["tokens"].append(tokens)
        self._steps["time"].append(self._clock() - self.origin)

    def _add_op(self, kind: OpKind, keys: Sequence[BlockKey], layer: int | None, source: int = 0) -> None:
        if not self._steps["kind"]:
            self._add_step(0, 0)  # calls before any begin_step: an implicit prefill step
        now = self._clock() - self.origin
        for key in keys:
            self._blocks.append(self._ids.setdefault(key, len(self._ids)))
            self._where.append(self._located(key))
        ops = self._ops
        ops["kind"].append(kind)
        ops["step"].append(len(self._steps["kind"]) - 1)
        ops["layer"].append(-1 if layer is None else layer)
        ops["count"].append(len(keys))
        ops["time"].append(now)
        ops["source"].append(source)

    @staticmethod
    def _store_names(manager: TierManager) -> tuple[str, ...]:
        return tuple(n for n in manager.order if manager.tiers[n].medium.value == "nvme")

    def _located(self, key: BlockKey) -> int:
        entry = None if self._manager is None else self._manager.directory.get(key)
        if entry is None:
            return NOWHERE
        found = next((i for i, name in enumerate(self._manager.order) if name in entry.copies), None)
        if found is not None:
            return found
        return ARRIVING if entry.arriving else NOWHERE


def _blocked(kinds: array, op_time: np.ndarray, events: list[Event], origin: float) -> np.ndarray:
    """Per op, how long the caller waited in it: until its ``wait`` (a get) or its ``put`` transfer ended.

    An event belongs to the last call that began before it (guesses are no
    calls); a get that found its blocks resident has no wait event and blocked
    nothing.
    """
    blocked = np.zeros(len(op_time))
    calls = [i for i, kind in enumerate(kinds) if kind != OpKind.GUESS]
    times = op_time[calls].tolist()
    for e in events:
        want, at = {"wait": (OpKind.GET, e.start), "put": (OpKind.PUT, e.submit)}.get(e.kind, (None, 0.0))
        j = bisect_right(times, at - origin) - 1 if want is not None else -1
        if j >= 0 and kinds[calls[j]] == want:
            blocked[calls[j]] = max(blocked[calls[j]], e.done - origin - times[j])
    return blocked


def _layer_starts(step_time: np.ndarray, layers: int, events: list[Event], origin: float) -> np.ndarray:
    """When each step's layers began ([steps, layers] flattened), from the engine's ``layer`` events."""
    starts = np.full((len(step_time), layers), math.nan)
    times = step_time.tolist()
    for e in events:
        if e.kind == EventKind.LAYER and e.layer is not None and e.layer < layers:
            step = bisect_right(times, e.start - origin) - 1
            if step >= 0 and math.isnan(starts[step, e.layer]):
                starts[step, e.layer] = e.start - origin
    return starts.reshape(-1)

