"""S3-FIFO (Yang et al., SOSP 2023): quick demotion of keys that are never reused.

Three FIFO queues, oldest first, and a use counter per key capped at 3::

    small  S  new keys                        ~10% of c
    main   M  keys used again while in S,     the rest of c
              or readmitted from G
    ghost  G  keys evicted from S, no data    as many as M holds

Evicting from S (while S holds at least its share): a key used since it
arrived moves to M with its counter cleared, an unused one leaves and is
remembered in G. Evicting from M: a used key goes back to M's newest end
with its counter lowered by one, an unused one leaves. Inserting a key that
G remembers puts it straight into M. A one-time scan only passes through S.

Here the manager decides when to evict and some keys are protected, so
``evict`` first checks that n unprotected keys exist (otherwise it returns
None untouched), then runs the algorithm; protected keys met at a queue's
old end are lifted off and put back there, in order, when it is done.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable
from dataclasses import dataclass, field
from itertools import chain

from policies.capacity import Capacity
from policies.registry import register
from policies.victims import first_unprotected
from tierkv.errors import ConfigError

MAX_USES = 3  # two bits per key in the paper

_Keys = OrderedDict[Hashable, None]


@dataclass(slots=True)
class _Lifted:
    """Protected keys taken off the old ends of S and M during one ``evict``."""

    small: list[Hashable] = field(default_factory=list)
    main: list[Hashable] = field(default_factory=list)

    def put_back(self, small: _Keys, main: _Keys) -> None:
        for queue, keys in ((small, self.small), (main, self.main)):
            for key in reversed(keys):
                queue[key] = None
                queue.move_to_end(key, last=False)


@register("s3fifo")
@dataclass(slots=True, eq=False)
class S3FIFOPolicy:
    capacity: int | None = None  # c in blocks; None: the most keys ever resident
    small_ratio: float = 0.1
    _size: Capacity = field(init=False, repr=False)
    _small: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _main: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _ghost: _Keys = field(default_factory=OrderedDict, init=False, repr=False)
    _uses: dict[Hashable, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._size = Capacity(self.capacity)
        if not 0.0 < self.small_ratio < 1.0:
            raise ConfigError(f"small_ratio={self.small_ratio!r}: must lie strictly between 0 and 1")

    def insert(self, key: Hashable) -> None:
        if key in self._uses:
            self.touch(key)
            return
        readmitted = key in self._ghost
        if readmitted:
            del self._ghost[key]
        (self._main if readmitted else self._small)[key] = None
        self._uses[key] = 0
        self._size.observe(len(self))

    def touch(self, key: Hashable) -> None:
        if key in self._uses:
            self._uses[key] = min(self._uses[key] + 1, MAX_USES)

    def remove(self, key: Hashable) -> None:
        if self._uses.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        if first_unprotected(chain(self._small, self._main), n, protected) is None:
            return None
        lifted = _Lifted()
        victims = [self._evict_one(protected, lifted) for _ in range(n)]
        lifted.put_back(self._small, self._main)
        return victims

    def __len__(self) -> int:
        return len(self._uses)

    def _evict_one(self, protected: Container[Hashable], lifted: _Lifted) -> Hashable:
        small_first = len(self._small) + len(lifted.small) >= self._small_share()
        # A failed pass over S leaves its unprotected keys in M, and a failed pass
        # over M leaves one in S, so the third pass at the latest finds a victim.
        for from_small in (small_first, not small_first, small_first):
            victim = self._evict_small(protected, lifted) if from_small else self._evict_main(protected, lifted)
            if victim is not None:
                return victim
        raise AssertionError("S3-FIFO found no victim although enough unprotected keys exist")

    def _evict_small(self, protected: Container[Hashable], lifted: _Lifted) -> Hashable | None:
        while self._small:
            key, _ = self._small.popitem(last=False)
            if key in protected:
                lifted.small.append(key)
            elif self._uses[key] > 0:
                self._uses[key] = 0
                self._main[key] = None
            else:
                del self._uses[key]
                self._remember(key)
                return key
        return None

    def _evict_main(self, protected: Container[Hashable], lifted: _Lifted) -> Hashable | None:
        while self._main:
            key, _ = self._main.popitem(last=False)
            if key in protected:
                lifted.main.append(key)
            elif self._uses[key] > 0:
                self._uses[key] -= 1
                self._main[key] = None
            else:
                del self._uses[key]
                return key
        return None

    def _remember(self, key: Hashable) -> None:
        self._ghost[key] = None
        for _ in range(len(self._ghost) - self._main_share()):
            self._ghost.popitem(last=False)

    def _small_share(self) -> int:
        return max(1, int(self._size.blocks * self.small_ratio))

    def _main_share(self) -> int:
        return max(1, self._size.blocks - self._small_share())
