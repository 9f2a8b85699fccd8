"""Least frequently used, O(1) per operation; among equal counts the least recent goes first.

Keys sit in buckets of equal use count; the buckets form a ring, lowest
count first, around a sentinel (count 0)::

    sentinel <-> [count 1: a, d] <-> [count 3: b] <-> [count 4: c] <-> sentinel
                  oldest use first

A use moves a key from its bucket to the end of the next count's bucket,
creating it next door when missing and dropping the old one when emptied,
so nothing is ever sorted. Counts never decay: a key that was hot long ago
stays until keys with more uses crowd it out.

``lfu`` forgets a key's count when it is evicted, so a key used on every
pass over a working set larger than the tier comes back at count 1 each
time and is evicted again before its next use: on such a cycle LFU hits no
more than LRU. ``lfu-history`` remembers the counts of evicted keys (up to
``ghosts_per_block`` per block of capacity, the oldest forgotten first) and
gives a key its count back when it returns, so the keys used most over the
whole run stay (the "perfect LFU" of the caching literature). A returning
key finds its count's place among the counts held, at worst one dict lookup
per lower count.

Sparse decode is such a cycle: each step reads 15-18K pages, more than a
20 % tier holds at 32K. In steady state (gpu tier 10 % and cpu tier 10 % of
the pages, the rest on NVMe) lfu-history on the gpu tier loaded 27 % fewer
pages from NVMe per step than LRU at 32K and 13 % fewer at 128K; on 2 CPU
cores the steps were no faster (its bookkeeping and the machine's noise ate
the difference), so LRU stays the default: ``--gpu-policy lfu-history``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterator
from dataclasses import dataclass, field

from policies.capacity import validate_capacity
from policies.ghosts import Ghosts
from policies.registry import register
from policies.victims import first_unprotected


@dataclass(slots=True, eq=False)
class _Bucket:
    count: int
    keys: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)
    prev: _Bucket = field(init=False, repr=False)
    next: _Bucket = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prev = self.next = self

    def link_after(self, other: _Bucket) -> None:
        self.prev, self.next = other, other.next
        other.next.prev = self
        other.next = self

    def unlink(self) -> None:
        self.prev.next, self.next.prev = self.next, self.prev


@register("lfu")
@dataclass(slots=True, eq=False)
class LFUPolicy:
    capacity: int | None = None  # accepted like every built-in; LFU needs no size
    _ring: _Bucket = field(default_factory=lambda: _Bucket(0), init=False, repr=False)
    _bucket_of: dict[Hashable, _Bucket] = field(default_factory=dict, init=False, repr=False)
    _by_count: dict[int, _Bucket] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        validate_capacity(self.capacity)

    def insert(self, key: Hashable) -> None:
        if key in self._bucket_of:
            self.touch(key)
            return
        self._place(key, self._bucket_after(self._ring, 1))

    def touch(self, key: Hashable) -> None:
        bucket = self._bucket_of.get(key)
        if bucket is None:
            return
        self._place(key, self._bucket_after(bucket, bucket.count + 1))
        self._take(key, bucket)

    def remove(self, key: Hashable) -> None:
        bucket = self._bucket_of.pop(key, None)
        if bucket is not None:
            self._take(key, bucket)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        victims = first_unprotected(self._coldest_first(), n, protected)
        for key in victims or ():
            self.remove(key)
        return victims

    def __len__(self) -> int:
        return len(self._bucket_of)

    def _coldest_first(self) -> Iterator[Hashable]:
        bucket = self._ring.next
        while bucket is not self._ring:
            yield from bucket.keys
            bucket = bucket.next

    def _bucket_after(self, bucket: _Bucket, count: int) -> _Bucket:
        if bucket.next is not self._ring and bucket.next.count == count:
            return bucket.next
        fresh = self._by_count[count] = _Bucket(count)
        fresh.link_after(bucket)
        return fresh

    def _bucket_for(self, count: int) -> _Bucket:
        """The bucket of ``count``, made after the highest lower count's when there is none."""
        bucket = self._by_count.get(count)
        if bucket is None:
            below = next((self._by_count[c] for c in range(count - 1, 0, -1) if c in self._by_count), self._ring)
            bucket = self._bucket_after(below, count)
        return bucket

    def _place(self, key: Hashable, bucket: _Bucket) -> None:
        bucket.keys[key] = None
        self._bucket_of[key] = bucket

    def _take(self, key: Hashable, bucket: _Bucket) -> None:
        del bucket.keys[key]
        if not bucket.keys:
            bucket.unlink()
            del self._by_count[bucket.count]


@register("lfu-history")
@dataclass(slots=True, eq=False)
class LFUHistoryPolicy(LFUPolicy):
    """LFU whose counts outlive eviction: a returning key resumes its count (see the module notes)."""

    ghosts_per_block: int = 4     # counts remembered per block of capacity
    _ghosts: Ghosts[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ghosts = Ghosts(self.capacity, self.ghosts_per_block)

    def insert(self, key: Hashable) -> None:
        if key in self._bucket_of:
            self.touch(key)
            return
        self._place(key, self._bucket_for(self._ghosts.take(key, 0) + 1))
        self._ghosts.resident(len(self._bucket_of))

    def remove(self, key: Hashable) -> None:
        """The block is gone: its count goes too."""
        LFUPolicy.remove(self, key)
        self._ghosts.forget(key)

    def evict(self, n: int, protected: Container[Hashable]) -> list[Hashable] | None:
        victims = first_unprotected(self._coldest_first(), n, protected)
        for key in victims or ():
            bucket = self._bucket_of.pop(key)
            self._ghosts.remember(key, bucket.count)
            self._take(key, bucket)
        return victims

    def count(self, key: Hashable) -> int:
        """Uses of a resident or remembered key (0 when unknown)."""
        bucket = self._bucket_of.get(key)
        return bucket.count if bucket is not None else self._ghosts.get(key, 0)
