"""StreamingLLM (Xiao et al., ICLR 2024): keep the attention sinks and the recent window.

Attention keeps pouring mass into the first tokens (the sinks) and into the
newest ones, so per layer those blocks stay; the blocks between them go
first, oldest insert first::

    layer l   [0] [1] [2] [3] [4] [5] [6] [7]       sinks=1, window=2, newest index 7
               sink  <---- evicted first ---->  window
                     (in the order they arrived)

Positions come from ``describe(key, layer=, index=)`` (see ``tierkv.policy``);
a key never described is an ordinary middle block, so without hints this is
FIFO. The window is measured from the newest index described for the layer
(one sequence per tier, as the native loop runs). Sinks and window blocks
are kept while anything else can go; when only they are left, the window
goes before the sinks, oldest first, so a tier smaller than them all still
works instead of failing the manager.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterator
from dataclasses import dataclass, field

from policies.capacity import validate_capacity
from policies.registry import register
from policies.victims import first_unprotected
from tierkv.errors import ConfigError

_Keys = OrderedDict[Hashable, None]


def validate_block_count(name: str, value: object) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return
    raise ConfigError(f"{name}={value!r}: expected a number of blocks >= 0")


@register("streaming")
@dataclass(slots=True, eq=False)
class StreamingPolicy:
    capacity: int | None = None  # accepted like every built-in; needs no size
    sinks: int = 1               # first blocks of each layer
    window: int = 1              # newest blocks of each layer
    _order: _Keys = field(default_factory=OrderedDict, init=False, repr=False)  # all but sinks
    _sinks: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _where: dict[Hashable, tuple[int | None, int]] = field(default_factory=dict, init=False, repr=False)
    _newest: dict[int | None, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_capacity(self.capacity)
        validate_block_count("sinks", self.sinks)
        validate_block_count("window", self.window)

    def insert(self, key: Hashable) -> None:
        if key not in self._sinks:
            self._order.setdefault(key, None)  # a key already held keeps its place

    def describe(self, key: Hashable, *, layer: int | None, index: int | None) -> None:
        if index is None or not (key in self._order or key in self._sinks):
            return
        self._where[key] = (layer, index)
        self._newest[layer] = max(self._newest.get(layer, index), index)
        if index < self.sinks and key in self._order:
            del self._order[key]
            self._sinks[key] = None

    def touch(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)
        self._sinks.pop(key, None)
        self._where.pop(key, None)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        victims = first_unprotected(self._ranked(), n, protected)
        for key in victims or ():
            self.remove(key)
        return victims

    def __len__(self) -> int:
        return len(self._order) + len(self._sinks)

    def _ranked(self) -> Iterator[Hashable]:
        """Every key, first to go first: the middle, then the window, then the sinks."""
        yield from (key for key in self._order if not self._in_window(key))
        yield from (key for key in self._order if self._in_window(key))
        yield from self._sinks

    def _in_window(self, key: Hashable) -> bool:
        where = self._where.get(key)
        return where is not None and where[1] > self._newest[where[0]] - self.window
