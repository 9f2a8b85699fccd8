"""A custom eviction policy in its own file: evict the block with the most recent key first (MRU).

Load it by name, without touching tierkv:

    TierConfig(..., cpu_policy="my_policy:MostRecentlyUsed")     # with examples/ on PYTHONPATH
    make_policy("my_policy:MostRecentlyUsed")

A policy only ranks keys; it never touches bytes or tiers. ``evict`` must
return exactly ``n`` victims outside ``protected`` and forget them, or
return None and change nothing.
"""
from collections import OrderedDict


class MostRecentlyUsed:
    def __init__(self, capacity: int | None = None) -> None:
        self._order: OrderedDict = OrderedDict()

    def insert(self, key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def evict(self, n, protected):
        victims = [k for k in reversed(self._order) if k not in protected][:n]
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)


if __name__ == "__main__":
    from policies import make_policy

    policy = make_policy("my_policy:MostRecentlyUsed")
    for key in "abcd":
        policy.insert(key)
    print("victims:", policy.evict(2, protected={"d"}))  # ['c', 'b']
