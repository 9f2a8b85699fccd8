"""Prefetchers for the replay: when, and which blocks, the recorded engine would have prefetched.

The names are those ``tierkv run`` takes, for the engine that recorded the
trace (``TraceMeta.engine``)::

    engine  name (tierkv run flag)          the replay issues
    dense   none (--prefetch)               nothing (the engine itself still reads one group ahead
                                            within a layer; the replay's none does not)
            next-layer                      group g+1 just before group g is acquired, and when layer l
                                            starts the blocks of layer l+1 its first group holds
            next-layer-all, streaming,      the same, with layer l+1's blocks picked by that
            previous-step, previous-layer,  policies.prefetch strategy (the previous-* ones learn from
            module:Class                    a sparse reader; the dense engine tells them nothing)
    sparse  none (--sparse-prefetch)        nothing
            speculative                     the guesses the run recorded (source "speculative"), as
                                            cold prefetches when it made them; a layer whose guesses
                                            held under half of what it then read is skipped
                                            (policies.selectors.Speculative, min_recall)
            previous-step                   when layer l starts in a decode step, layer l+1's blocks
                                            of the previous decode step, cold

A sparse prefetch larger than one gather group (half the read tier) is not
issued, as the sparse engine does not. ``engine``, the replay's name for
next-layer before it took the run's names, still means next-layer.

A prefetcher turns a trace into requests "before op ``at``, ``lead`` seconds
before it starts (never before the previous op ended), fetch these blocks for
the layer of op ``target``". The engine's prefetch callback runs before its
acquire, and the moves the prefetch spawns after the acquire marked its
blocks wanted; the replay's driver keeps that order.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from policies.prefetch import make_prefetch, prefetch_policies
from policies.selectors import Speculative
from tierkv.errors import ConfigError
from tierkv.profile.access_trace import STEP_KINDS, AccessTrace, OpKind, TraceMeta

ALIASES = {"engine": "next-layer"}
SPECULATIVE = "speculative"   # the guess source the sparse engine records
MIN_RECALL = Speculative().min_recall


@dataclass(frozen=True, slots=True)
class Prefetch:
    at: int       # issued before op ``at`` starts ...
    lead: float   # ... this many seconds before it (never before op at-1 ended)
    target: int   # the op whose layer it loads for, and whose blocks unless ``blocks`` names them
    blocks: tuple[int, ...] | None = None   # dense block ids
    guess: bool = False                      # a guess: the blocks enter their tier cold


# -- reading a trace by layer ----------------------------------------------------------
def _gets_by_layer(trace: AccessTrace) -> dict[tuple[int, int], list[int]]:
    gets: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in np.flatnonzero(trace.op_kind == OpKind.GET).tolist():
        gets[(int(trace.op_step[i]), int(trace.op_layer[i]))].append(i)
    return gets


def _first_calls(trace: AccessTrace) -> dict[tuple[int, int], int]:
    """The first call (put or get, not a guess) of each (step, layer): where the layer starts."""
    first: dict[tuple[int, int], int] = {}
    calls = np.flatnonzero(trace.op_kind != OpKind.GUESS).tolist()
    for i, step, layer in zip(calls, trace.op_step[calls].tolist(), trace.op_layer[calls].tolist()):
        first.setdefault((step, layer), i)
    return first


def _blocks_of(trace: AccessTrace, ops: list[int], start: np.ndarray) -> list[int]:
    """The blocks ops read, in order, each once."""
    return list(dict.fromkeys(b for i in ops for b in trace.block[start[i]:start[i + 1]].tolist()))


def _layer_lead(trace: AccessTrace, step: int, layer: int, at: int) -> float:
    """How long before op ``at`` its layer began (0 when the trace does not know)."""
    if layer >= trace.meta.layers:
        return 0.0
    began = trace.layer_start[step * trace.meta.layers + layer]
    return 0.0 if np.isnan(began) else max(0.0, float(trace.op_time[at] - began))


# -- the dense engine ------------------------------------------------------------------------
def dense_prefetch(trace: AccessTrace, name: str = "next-layer") -> list[Prefetch]:
    """As `tierkv.model.engine.Engine` with ``--prefetch name`` (see the module doc)."""
    if name == "none":
        return []
    strategy, start = make_prefetch(name), trace.op_start()
    gets = _gets_by_layer(trace)
    plan = [Prefetch(i, 0.0, j) for ops in gets.values() for i, j in zip(ops, ops[1:])]
    for (step, layer), at in _first_calls(trace).items():
        following = gets.get((step, layer + 1)) if layer >= 0 else None
        if not following:
            continue
        depth = int(trace.op_count[following[0]])     # the engine's group: as many as its first read
        chosen = strategy.plan(layer + 1, _blocks_of(trace, following, start), depth)
        if chosen:
            plan.append(Prefetch(at, _layer_lead(trace, step, layer, at), following[0], tuple(chosen)))
    return plan


# -- the sparse engine ------------------------------------------------------------------------
def no_prefetch(trace: AccessTrace) -> list[Prefetch]:
    return []


def speculative_prefetch(trace: AccessTrace, min_recall: float = MIN_RECALL) -> list[Prefetch]:
    """The recorded speculative guesses, each when it was made, but for a layer whose guesses have
    held under ``min_recall`` of what it then read (a moving average of the share, per layer, scored
    when the layer's next guess comes, as the engine's prefetcher scores its last guess)."""
    start, reads = trace.op_start(), _gets_by_layer(trace)
    last: dict[int, tuple[int, set[int]]] = {}     # layer -> (step, blocks) of its last guess
    recall: dict[int, float] = {}
    plan = []
    for i in trace.guesses(SPECULATIVE).tolist():
        step, layer = int(trace.op_step[i]), int(trace.op_layer[i])
        if layer in last:
            made, held = last[layer]
            read = set(_blocks_of(trace, reads.get((made, layer), []), start))
            if read:
                hit = len(held & read) / len(read)
                recall[layer] = hit if layer not in recall else (recall[layer] + hit) / 2
        last[layer] = (step, set(_blocks_of(trace, [i], start)))
        if recall.get(layer, 1.0) >= min_recall:
            plan.append(Prefetch(i, 0.0, i, guess=True))
    return plan


def previous_step_prefetch(trace: AccessTrace) -> list[Prefetch]:
    """In a decode step, when layer l starts: the blocks layer l+1 read in the previous decode step."""
    start, gets = trace.op_start(), _gets_by_layer(trace)
    decode = np.flatnonzero(trace.step_kind == STEP_KINDS.index("decode")).tolist()
    previous = dict(zip(decode[1:], decode))
    plan = []
    for (step, layer), at in _first_calls(trace).items():
        read = gets.get((previous[step], layer + 1)) if step in previous and layer >= 0 else None
        if read:
            blocks = tuple(_blocks_of(trace, read, start))
            plan.append(Prefetch(at, _layer_lead(trace, step, layer, at), read[0], blocks, guess=True))
    return plan


SPARSE: dict[str, Callable[[AccessTrace], list[Prefetch]]] = {
    "none": no_prefetch, SPECULATIVE: speculative_prefetch, "previous-step": previous_step_prefetch}


# -- names -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The prefetcher names of one engine, as ``tierkv run`` takes them."""

    flag: str                                             # the tierkv run flag
    config_key: str                                       # its key in a tierkv-run-config file
    names: Callable[[], list[str]]
    plan: Callable[[AccessTrace, str], list[Prefetch]]
    default: str                                          # the engine's own default
    custom: bool = False                                  # module:Class names a policies.prefetch strategy


VOCABULARIES = {
    "dense": Vocabulary("--prefetch", "prefetch", prefetch_policies, dense_prefetch, "next-layer", custom=True),
    "sparse": Vocabulary("--sparse-prefetch", "sparse_prefetch", lambda: list(SPARSE),
                         lambda trace, name: SPARSE[name](trace), "none"),
}


def check_prefetch(name: str | None) -> None:
    """ConfigError unless ``name`` is a prefetcher of some engine (which one applies is known only
    with the trace: `resolve_prefetch`)."""
    if name is None or name in ALIASES or any(name in v.names() for v in VOCABULARIES.values()):
        return
    if ":" in name:
        make_prefetch(name)   # a custom strategy that does not load is its own clear error
        return
    raise ConfigError(f"prefetch={name!r}: unknown; " + "; ".join(
        f"for a trace of the {engine} engine (tierkv run {v.flag}): {', '.join(v.names())}"
        for engine, v in VOCABULARIES.items()))


def resolve_prefetch(name: str | None, meta: TraceMeta) -> str:
    """The prefetcher a replay of a trace with ``meta`` runs for ``name`` (None: the recording
    engine's default; an alias: its name); ConfigError when it does not apply, naming what does."""
    check_prefetch(name)
    vocab = VOCABULARIES[meta.engine]
    resolved = vocab.default if name is None else ALIASES.get(name, name)
    if resolved == SPECULATIVE and SPECULATIVE not in meta.sources:
        raise ConfigError(f"prefetch={name!r} replays the guesses a sparse run records, and this trace holds "
                          "none: record it with `tierkv run --mode sparse --record-access FILE`")
    if resolved in vocab.names() or (vocab.custom and ":" in resolved):   # check_prefetch loaded a custom one
        return resolved
    raise ConfigError(f"prefetch={name!r}: not one of the {meta.engine} engine's, which recorded this trace; "
                      f"its prefetchers (tierkv run {vocab.flag}): {', '.join(vocab.names())}")


def plan_prefetch(trace: AccessTrace, name: str | None) -> list[Prefetch]:
    """What ``name`` (see `resolve_prefetch`) would have prefetched over ``trace``."""
    return VOCABULARIES[trace.meta.engine].plan(trace, resolve_prefetch(name, trace.meta))
