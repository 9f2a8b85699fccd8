"""Least frequently used, O(1) per operation; among equal counts the least recent goes first.

Keys sit in buckets of equal use count; the buckets form a ring, lowest
count first, around a sentinel (count 0)::

    sentinel <-> [count 1: a, d] <-> [count 3: b] <-> [count 4: c] <-> sentinel
                  oldest use first

A use moves a key from its bucket to the end of the next count's bucket,
creating it next door when missing and dropping the old one when emptied,
so nothing is ever sorted. Counts never decay: a key that was hot long ago
stays until keys with more uses crowd it out.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterator
from dataclasses import dataclass, field

from policies.capacity import validate_capacity
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
        fresh = _Bucket(count)
        fresh.link_after(bucket)
        return fresh

    def _place(self, key: Hashable, bucket: _Bucket) -> None:
        bucket.keys[key] = None
        self._bucket_of[key] = bucket

    @staticmethod
    def _take(key: Hashable, bucket: _Bucket) -> None:
        del bucket.keys[key]
        if not bucket.keys:
            bucket.unlink()
