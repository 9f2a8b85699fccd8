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

With a ``BufferBudget`` a layer also keeps its whole K/V as one tensor that only appends
(``tierkv.model.kv_buffer``): ``contiguous()`` returns it, and a step then reads no block.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch

from tierkv.errors import BlockMissing
from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.model.kv_buffer import BufferBudget, KVBuffer

KeyOf = Callable[[int], BlockKey]     # block index -> the key it is sealed under


class LayerKV:
    def __init__(self, manager: BlockingTierManager, layout: BlockLayout, layer: int, *,
                 read_tier: str | None = None, budget: BufferBudget | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.manager, self.layout, self.layer, self.read_tier = manager, layout, layer, read_tier
        self.blocks: list[BlockKey] = []
        shape = layout.fields[0].shape                                   # [B, Hkv, T, D]
        # on the compute device: a step's K/V are appended and read back without leaving it. Made as plain
        # tensors even under torch.inference_mode(), which a cache filled there and used after it writes to
        with torch.inference_mode(False):
            self.tail_k = torch.empty(shape, dtype=layout.dtype, device=device)
            self.tail_v = torch.empty(shape, dtype=layout.dtype, device=device)
        self.tail_len = 0
        self.budget, self.device = budget, device
        # a lossy codec's last sealed block, exact ([index, K, V]): a crop into it (a rejected draft, a step
        # back) makes the tokens it keeps the tail again, and they must be their own values, not decoded ones
        self.exact_last: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.buffer: KVBuffer | None = None      # made at the first read that can use one

    @property
    def length(self) -> int:
        return len(self.blocks) * self.layout.tokens + self.tail_len

    # -- writing --------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, key_of: KeyOf, *, persist: bool) -> None:
        """K/V ``[B, Hkv, t, D]`` of new tokens; the blocks that fill are sealed into the tiers together
        (one put), and only then does the tail take the rest (a failed put changes nothing)."""
        T, t, have = self.layout.tokens, k.shape[2], self.tail_len
        full = (have + t) // T
        if full:
            ks = torch.cat([self.tail_k[:, :, :have], k], dim=2) if have else k
            vs = torch.cat([self.tail_v[:, :, :have], v], dim=2) if have else v
            self._seal(ks[:, :, :full * T], vs[:, :, :full * T], key_of, persist)
            k, v, have = ks[:, :, full * T:], vs[:, :, full * T:], 0
        self.tail_k[:, :, have:have + k.shape[2]].copy_(k)
        self.tail_v[:, :, have:have + v.shape[2]].copy_(v)
        self.tail_len = have + k.shape[2]

    def _seal(self, k: torch.Tensor, v: torch.Tensor, key_of: KeyOf, persist: bool) -> None:
        """Whole blocks of K/V ``[B, Hkv, n*T, D]`` into the tiers, in one put."""
        first, T = len(self.blocks), self.layout.tokens
        n = k.shape[2] // T
        as_blocks = [x.unflatten(2, (n, T)).movedim(2, 0).cpu() for x in (k, v)]   # [n, B, Hkv, T, D]
        raws = self.layout.pack(*as_blocks)                  # [n, block_bytes]; sealed from host memory
        keys = [key_of(first + i) for i in range(n)]
        self.manager.put_many(keys, raws, layer=self.layer, first_index=first, persist=persist)
        self.blocks.extend(keys)
        if self.layout.codec is not None:
            self.exact_last = (first + n - 1, as_blocks[0][-1].clone(), as_blocks[1][-1].clone())
        buffer = self.buffer
        for index, raw in enumerate(raws, start=first):
            if buffer is not None and buffer.filled == index * T and buffer.reserve((index + 1) * T):
                buffer.write(index * T, *self.layout.unpack(raw))      # as stored: a lossy codec's values
                buffer.filled += T

    def adopt(self, key: BlockKey) -> None:
        """Take a block already stored (and held for this sequence) as the next one."""
        if self.tail_len:
            raise ValueError(f"layer {self.layer}: cannot adopt a block after a partial tail")
        self.blocks.append(key)

    # -- branching ------------------------------------------------------------------------
    def fork(self) -> LayerKV:
        """A branch: every block held once more, the tail copied."""
        if self.blocks and not self.manager.protect(self.blocks):
            raise BlockMissing(f"layer {self.layer}: a block of the sequence to fork is no longer stored")
        twin = copy.copy(self)
        twin.blocks = list(self.blocks)
        with torch.inference_mode(False):
            twin.tail_k, twin.tail_v = self.tail_k.clone(), self.tail_v.clone()
        twin.buffer = None            # its own, filled from the shared blocks at its first read
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
        if rest and self.exact_last is not None and self.exact_last[0] == whole:
            _, k, v = self.exact_last             # (a lossy codec's block: its tokens as they were computed)
            self.tail_k[:, :, :rest].copy_(k[:, :, :rest])
            self.tail_v[:, :, :rest].copy_(v[:, :, :rest])
        elif rest:                                # the block that now ends the sequence becomes the tail
            with self.manager.blocks([self.blocks[whole]], self.read_tier, layer=self.layer) as views:
                k, v = self.layout.unpack(views[0])
                self.tail_k[:, :, :rest].copy_(k[:, :, :rest])
                self.tail_v[:, :, :rest].copy_(v[:, :, :rest])
        self.let_go(self.blocks[whole:], keep=keep)
        if self.exact_last is not None and self.exact_last[0] >= whole:
            self.exact_last = None
        self.blocks, self.tail_len = self.blocks[:whole], rest
        self._forget_after(whole)

    def truncate(self, n_blocks: int, *, keep: bool) -> None:
        """Forget everything from block ``n_blocks`` on."""
        self.let_go(self.blocks[n_blocks:], keep=keep)
        self.blocks, self.tail_len = self.blocks[:n_blocks], 0
        self._forget_after(n_blocks)
        if self.exact_last is not None and self.exact_last[0] >= n_blocks:
            self.exact_last = None

    def _forget_after(self, n_blocks: int) -> None:
        if self.buffer is not None:
            self.buffer.filled = min(self.buffer.filled, n_blocks * self.layout.tokens)

    def let_go(self, keys: list[BlockKey], *, keep: bool) -> None:
        if keys:
            (self.manager.unprotect if keep else self.manager.drop)(keys)

    def release(self, *, keep: bool) -> None:
        self.let_go(self.blocks, keep=keep)
        self.blocks, self.tail_len, self.exact_last = [], 0, None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None

    # -- reading --------------------------------------------------------------------------
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tail_k[:, :, :self.tail_len], self.tail_v[:, :, :self.tail_len]

    @property
    def reads_blocks(self) -> bool:
        """A read would load blocks from the tiers (there is no buffer, or it lacks some)."""
        return self.buffer is None or self.buffer.filled < len(self.blocks) * self.layout.tokens

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V [B, Hkv, length, D] as one tensor each (views of the layer's buffer): the blocks not in
        it yet are read from the tiers once and appended, then the tail. None without a budget, or
        where it has no room (the caller reads ``groups``)."""
        if self.budget is None:
            return None
        if self.buffer is None:
            shape = self.layout.fields[0].shape
            self.buffer = KVBuffer(shape, self.layout.dtype, self.device, self.budget)
        buffer, T = self.buffer, self.layout.tokens
        if not buffer.reserve(self.length):
            self.buffer = self.budget = None     # the budget is spent: this layer reads blocks from now on
            return None
        sealed = len(self.blocks)
        if buffer.filled < sealed * T:
            first = buffer.filled // T
            for start, blocks in self.groups(self.manager.pin_group(), first=first):
                for i, (k, v) in enumerate(blocks):
                    buffer.write((start + i) * T, k, v)
            buffer.filled = sealed * T
        if self.tail_len:
            buffer.write(sealed * T, *self.tail())
        return buffer.view(self.length)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every token [B, Hkv, length, D] on the layer's device, copied: the sealed blocks its
        buffer holds, the others read from the tiers (BlockMissing where one is lost or damaged), then the
        tail. Unlike ``contiguous`` it reserves and keeps nothing: the layer reads as it did before."""
        T = self.layout.tokens
        have = 0 if self.buffer is None else min(self.buffer.filled // T, len(self.blocks))
        parts = [self.buffer.view(have * T)] if have else []
        for _, blocks in self.groups(self.manager.pin_group(), first=have):     # (views valid for one group)
            parts.append(tuple(torch.cat([block[i] for block in blocks], dim=2).to(self.device) for i in (0, 1)))
        parts.append(self.tail())
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def groups(self, group: int, *, first: int = 0) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Pinned K/V views of the sealed blocks, ``group`` blocks at a time: ``(first index, [(k, v)])``,
        valid until the next iteration. The next group is prefetched while one is used."""
        keys = self.blocks
        for start in range(first, len(keys), group):
            if start + group < len(keys):
                self.manager.prefetch(keys[start + group:start + 2 * group], self.read_tier, layer=self.layer)
            with self.manager.blocks(keys[start:start + group], self.read_tier, layer=self.layer) as views:
                yield start, [self.layout.unpack(raw) for raw in views]
