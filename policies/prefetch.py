"""Prefetch strategies, chosen by name: which blocks of the next layer to load ahead.

Before a reader computes layer ``l - 1`` it asks ``plan(l, blocks, depth)``
for the keys of layer ``l`` to start loading (see ``tierkv.policy``)::

    layer l blocks   [0] [1] [2] [3] [4] [5] [6] [7]          depth = 3
    none              .   .   .   .   .   .   .   .
    next-layer        x   x   x   .   .   .   .   .           the first group, read first
    next-layer-all    x   x   x   x   x   x   x   x           may crowd out what it loads
    streaming         x   .   .   .   .   .   x   x           sinks + recent window
    previous-step     blocks layer l attended to last step (ShadowKV reuses ~those chunks)
    previous-layer    blocks layer l-1 attended to this step (InfiniGen's cross-layer guess)

The two ``previous-*`` strategies learn from ``selected(layer, indices)``,
which a sparse reader calls; until told anything they plan like next-layer.

``make_prefetch("next-layer")`` builds one; ``prefetch_policies()`` lists the
names; ``"module:Class"`` loads a custom one. Unknown names and bad
parameters raise ``ConfigError`` naming the valid ones.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from policies.registry import Registry
from policies.streaming import validate_block_count
from tierkv.policy import PrefetchPolicy

PREFETCH: Registry[PrefetchPolicy] = Registry("prefetch", PrefetchPolicy, ("plan",))
register_prefetch = PREFETCH.register
prefetch_policies = PREFETCH.names
make_prefetch = PREFETCH.make


def _check_depth(depth: int) -> None:
    if depth < 0:
        raise ValueError(f"depth={depth}: cannot prefetch a negative number of blocks")


@register_prefetch("none")
@dataclass(slots=True)
class NoPrefetch:
    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        _check_depth(depth)
        return []


@register_prefetch("next-layer")
@dataclass(slots=True)
class NextLayer:
    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        _check_depth(depth)
        return list(blocks[:depth])


@register_prefetch("next-layer-all")
@dataclass(slots=True)
class NextLayerAll:
    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        _check_depth(depth)
        return list(blocks)


@register_prefetch("streaming")
@dataclass(slots=True)
class SinksAndWindow:
    sinks: int = 1
    window: int = 1

    def __post_init__(self) -> None:
        validate_block_count("sinks", self.sinks)
        validate_block_count("window", self.window)

    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        _check_depth(depth)
        first = list(blocks[:self.sinks])
        recent = list(blocks[max(len(first), len(blocks) - self.window):])
        return (first + recent)[:depth]


@dataclass(slots=True)
class _Remembered:
    """Block indices a sparse reader last attended to, per layer."""

    chosen: dict[int, list[int]] = field(default_factory=dict)

    def selected(self, layer: int, indices: Sequence[int]) -> None:
        self.chosen[layer] = list(indices)

    def pick(self, source: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        _check_depth(depth)
        indices = self.chosen.get(source)
        if indices is None:
            return list(blocks[:depth])
        return [blocks[i] for i in indices if 0 <= i < len(blocks)][:depth]


@register_prefetch("previous-step")
@dataclass(slots=True)
class PreviousStep(_Remembered):
    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        return self.pick(layer, blocks, depth)


@register_prefetch("previous-layer")
@dataclass(slots=True)
class PreviousLayer(_Remembered):
    def plan(self, layer: int, blocks: Sequence[Hashable], depth: int) -> list[Hashable]:
        return self.pick(layer - 1, blocks, depth)
