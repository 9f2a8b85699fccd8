"""Eviction strategies for tierkv's tiers, chosen by name.

Policies rank, the manager acts (see ``tierkv.policy``): a strategy sees
only keys. ``make_policy("arc", capacity=4096)`` builds one; ``available()``
lists the names; ``"module:Class"`` loads a custom one.

Every built-in accepts ``capacity`` (the tier's size in blocks) so the
manager can build any of them the same way; LRU, FIFO and LFU ignore it, ARC
and S3-FIFO size their queues from it, and lfu-history and H2O their memory
of evicted keys; without it, from the most keys ever resident at once.

What the protocol leaves open, every built-in answers alike:

* ``insert`` is a block's first use. Inserting a key already held counts as a
  use (FIFO keeps its place). A manager that also touches a block it has just
  inserted, or touches a block on every step of one request, makes every block
  look reused and undoes what LFU, ARC and S3-FIFO learn from reuse.
* ``touch`` and ``remove`` of a key the policy does not hold do nothing.
* ``evict(0, ...)`` is ``[]``; a negative count raises ``ValueError``. Its cost
  is O(n + protected keys passed over); everything else is O(1) (amortized).

===========  ======================================================  ==============
name         evicts first                                            module
===========  ======================================================  ==============
lru          least recently used                                     ``lru.py``
fifo         oldest insert; use does not matter                      ``fifo.py``
lfu          least often used, least recent among equals             ``lfu.py``
lfu-history  the same, counting the uses before an eviction too      ``lfu.py``
arc          adaptive split between once-used and reused (ARC)       ``arc.py``
s3fifo       new keys not reused since insert (S3-FIFO)              ``s3fifo.py``
streaming    not the sinks or the recent window; oldest first        ``streaming.py``
h2o          least accumulated attention, then least recently used  ``h2o.py``
===========  ======================================================  ==============

``streaming`` and ``h2o`` use the optional hints of ``tierkv.policy``
(``describe``, ``observe``); without them they act as FIFO and LRU.

Prefetch strategies (which blocks of the next layer to load ahead) have a
registry of their own: ``make_prefetch("next-layer")``, ``prefetch_policies()``
(see ``prefetch.py``).

Chunk selectors and sparse prefetchers for sparse decode work on tensors, so
they live in ``policies.selectors``, imported on their own: ``import policies``
stays free of torch. Its ``near-memory`` selector is the CXL tier's
(`tierkv.tiers.cxl_select`), named by path.
"""
from __future__ import annotations

from policies import arc, fifo, h2o, lfu, lru, s3fifo, streaming  # noqa: F401  importing registers them
from policies.prefetch import make_prefetch, prefetch_policies, register_prefetch
from policies.registry import available, make_policy, register

__all__ = ["available", "make_policy", "make_prefetch", "prefetch_policies", "register", "register_prefetch"]
