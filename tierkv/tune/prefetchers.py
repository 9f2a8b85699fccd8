"""Prefetchers for the replay: when, and which blocks, a run would have prefetched.

A prefetcher turns a trace into requests "before op ``at``, ``lead`` seconds
before it starts (never before the previous op ended), fetch the blocks of
get op ``target``". ``engine`` does what `tierkv.model.engine.Engine` does:
the first group of layer l+1 when layer l starts, group g+1 just before group
g is acquired. The engine's prefetch callback runs before its acquire, and the
moves the prefetch spawns after the acquire marked its blocks wanted; the
replay's driver keeps that order.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierkv.profile.access_trace import AccessTrace, OpKind


@dataclass(frozen=True, slots=True)
class Prefetch:
    at: int       # issued before op ``at`` starts ...
    lead: float   # ... this many seconds before it (never before op at-1 ended)
    target: int   # the get op whose blocks it fetches


def _gets_by_layer(trace: AccessTrace) -> dict[tuple[int, int], list[int]]:
    gets: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in np.flatnonzero(trace.op_kind == OpKind.GET).tolist():
        gets[(int(trace.op_step[i]), int(trace.op_layer[i]))].append(i)
    return gets


def no_prefetch(trace: AccessTrace) -> list[Prefetch]:
    return []


def next_get_prefetch(trace: AccessTrace) -> list[Prefetch]:
    """Each get prefetches the next get of its step."""
    gets = np.flatnonzero(trace.op_kind == OpKind.GET).tolist()
    return [Prefetch(i, 0.0, j) for i, j in zip(gets, gets[1:]) if trace.op_step[i] == trace.op_step[j]]


def engine_prefetch(trace: AccessTrace) -> list[Prefetch]:
    """As the engine: layer l+1's first group when layer l starts; group g+1 before group g is acquired."""
    gets = _gets_by_layer(trace)
    plan = [Prefetch(i, 0.0, j) for ops in gets.values() for i, j in zip(ops, ops[1:])]
    first: dict[tuple[int, int], int] = {}
    for i, (step, layer) in enumerate(zip(trace.op_step.tolist(), trace.op_layer.tolist())):
        first.setdefault((step, layer), i)
    for (step, layer), at in first.items():
        following = gets.get((step, layer + 1)) if layer >= 0 else None
        if following:
            plan.append(Prefetch(at, _layer_lead(trace, step, layer, at), following[0]))
    return plan


def _layer_lead(trace: AccessTrace, step: int, layer: int, at: int) -> float:
    """How long before op ``at`` its layer began (0 when the trace does not know)."""
    if layer >= trace.meta.layers:
        return 0.0
    began = trace.layer_start[step * trace.meta.layers + layer]
    return 0.0 if np.isnan(began) else max(0.0, float(trace.op_time[at] - began))


PREFETCHERS: dict[str, Callable[[AccessTrace], list[Prefetch]]] = {
    "none": no_prefetch, "next": next_get_prefetch, "engine": engine_prefetch}
