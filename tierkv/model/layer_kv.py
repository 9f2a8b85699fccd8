"""One layer of one sequence's dense KV: sealed blocks in the tiers, the newest tokens in a tail.

    tokens   0 ........ 255 | 256 ....... 511 | 512 .. 600
    blocks   [ key 0        ] [ key 1         ] [ tail (89) ]     sealed: tiers; tail: memory

A sequence (``tierkv.model.sequence``) keeps one per layer; ``tierkv.hf.TieredCache`` one per
layer and batch row, since transformers reorders, repeats and crops a layer at a time. Blocks
are held (``BlockingTierManager.protect``): a fork holds them once more, and letting go of a
block frees it only when no other sequence holds it. A block is immutable, so branches share
every sealed block; the tail, the one part still written to, is each branch's own copy::

    fork      blocks shared (held twice), tail copied
    crop(n)   the last n tokens gone: whole blocks let go of, the block that now ends the
              sequence read back into the tail
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch

from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager

KeyOf = Callable[[int], BlockKey]     # block index -> the key it is sealed under


class LayerKV:
    def __init__(self, manager: BlockingTierManager, layout: BlockLayout, layer: int, *,
                 read_tier: str | None = None) -> None:
        self.manager, self.layout, self.layer, self.read_tier = manager, layout, layer, read_tier
        self.blocks: list[BlockKey] = []
        shape = layout.fields[0].shape                                   # [B, Hkv, T, D]
        self.tail_k, self.tail_v = torch.empty(shape, dtype=layout.dtype), torch.empty(shape, dtype=layout.dtype)
        self.tail_len = 0

    @property
    def length(self) -> int:
        return len(self.blocks) * self.layout.tokens + self.tail_len

    # -- writing --------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, key_of: KeyOf, *, persist: bool) -> None:
        """K/V ``[B, Hkv, t, D]`` of new tokens; every block that fills is sealed into the tiers."""
        T, done = self.layout.tokens, 0
        while done < k.shape[2]:
            take = min(T - self.tail_len, k.shape[2] - done)
            self.tail_k[:, :, self.tail_len:self.tail_len + take].copy_(k[:, :, done:done + take])
            self.tail_v[:, :, self.tail_len:self.tail_len + take].copy_(v[:, :, done:done + take])
            self.tail_len += take
            done += take
            if self.tail_len == T:
                self._seal(key_of(len(self.blocks)), persist)

    def _seal(self, key: BlockKey, persist: bool) -> None:
        index = len(self.blocks)
        self.manager.put(key, self.layout.pack(self.tail_k, self.tail_v), layer=self.layer, index=index,
                         persist=persist)
        self.blocks.append(key)
        self.tail_len = 0

    def adopt(self, key: BlockKey) -> None:
        """Take a block already stored (and held for this sequence) as the next one."""
        if self.tail_len:
            raise ValueError(f"layer {self.layer}: cannot adopt a block after a partial tail")
        self.blocks.append(key)

    # -- branching ------------------------------------------------------------------------
    def fork(self) -> LayerKV:
        """A branch: every block held once more, the tail copied."""
        if self.blocks and not self.manager.protect(self.blocks):
            raise RuntimeError(f"layer {self.layer}: a block of the sequence to fork is no longer stored")
        twin = copy.copy(self)
        twin.blocks = list(self.blocks)
        twin.tail_k, twin.tail_v = self.tail_k.clone(), self.tail_v.clone()
        return twin

    def crop(self, tokens: int, *, keep: bool) -> None:
        """Forget the last ``tokens`` tokens (``keep``: blocks let go of stay as reusable cache)."""
        if not 0 <= tokens <= self.length:
            raise ValueError(f"crop: {tokens} tokens of a layer holding {self.length}")
        if tokens <= self.tail_len:
            self.tail_len -= tokens
            return
        T, left = self.layout.tokens, self.length - tokens
        whole, rest = divmod(left, T)
        if rest:                                  # the block that now ends the sequence becomes the tail
            with self.manager.blocks([self.blocks[whole]], self.read_tier, layer=self.layer) as views:
                k, v = self.layout.unpack(views[0])
                self.tail_k[:, :, :rest].copy_(k[:, :, :rest])
                self.tail_v[:, :, :rest].copy_(v[:, :, :rest])
        self.let_go(self.blocks[whole:], keep=keep)
        self.blocks, self.tail_len = self.blocks[:whole], rest

    def let_go(self, keys: list[BlockKey], *, keep: bool) -> None:
        if keys:
            (self.manager.unprotect if keep else self.manager.drop)(keys)

    def release(self, *, keep: bool) -> None:
        self.let_go(self.blocks, keep=keep)
        self.blocks, self.tail_len = [], 0

    # -- reading --------------------------------------------------------------------------
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tail_k[:, :, :self.tail_len], self.tail_v[:, :, :self.tail_len]

    def groups(self, group: int) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Pinned K/V views of the sealed blocks, ``group`` blocks at a time: ``(first index, [(k, v)])``,
        valid until the next iteration. The next group is prefetched while one is used."""
        keys = self.blocks
        for start in range(0, len(keys), group):
            if start + group < len(keys):
                self.manager.prefetch(keys[start + group:start + 2 * group], self.read_tier, layer=self.layer)
            with self.manager.blocks(keys[start:start + group], self.read_tier, layer=self.layer) as views:
                yield start, [self.layout.unpack(raw) for raw in views]
