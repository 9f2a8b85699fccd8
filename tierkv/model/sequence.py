"""The KV of one sequence, kept in tierkv's tiers block by block.

Per layer, K and V of ``block_tokens`` consecutive tokens form one block.
Sealed blocks live in the tier manager (protected: tierkv must not lose
them); the newest, still-filling block stays in a tail buffer::

    tokens   0 ........ 255 | 256 ....... 511 | 512 .. 600
    layer l  [ block l,0   ] [ block l,1     ] [ tail (89) ]   <- sealed blocks: tiers
    bytes    K[B,Hkv,T,D] then V[B,Hkv,T,D], padded to a multiple of 4096

Block keys are content addresses (see tierkv.keys) when the token ids are
known, so a later run over the same prefix finds the blocks again; without
token ids (a transformers cache sees only K/V) each sequence gets a fresh
random root and its blocks are private.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from tierkv.keys import BlockKey, layer_keys, prefix_keys, root_key
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.policy import PrefetchPolicy


class TieredSequence:
    """K/V of one sequence: sealed blocks in the tiers, the newest tokens in a tail per layer."""

    def __init__(self, manager: BlockingTierManager, layout: BlockLayout, *, model_id: str | None = None,
                 persist: bool = False) -> None:
        self.manager = manager
        self.layout = layout
        self.persist = persist
        self.read_tier: str | None = None   # None: read blocks from any memory tier in place
        self.root = root_key(model_id, layout.name, str(layout.dtype)) if model_id else \
            BlockKey.of("private", os.urandom(16))
        self.token_ids: list[int] = []
        self._prefixes: list[BlockKey] = []   # prefix key of each full block of token_ids
        self.blocks: list[list[BlockKey]] = [[] for _ in range(layout.num_layers)]
        self.tail_len = [0] * layout.num_layers
        shape = layout.fields[0].shape
        self._tail = [(torch.empty(shape, dtype=layout.dtype), torch.empty(shape, dtype=layout.dtype))
                      for _ in range(layout.num_layers)]

    # -- keys --------------------------------------------------------------
    def block_key(self, layer: int, index: int) -> BlockKey:
        """Key of block ``index`` of ``layer``: content-addressed once its tokens are known."""
        return layer_keys(self._prefix(index), [layer])[0]

    def _prefix(self, index: int) -> BlockKey:
        if index < len(self._prefixes):
            return self._prefixes[index]
        return BlockKey.of(self.root.digest, "block", index)

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        """Record the ids of tokens about to be appended (makes block keys content addresses)."""
        self.token_ids.extend(int(t) for t in token_ids)
        T = self.layout.tokens
        done = len(self._prefixes) * T
        parent = self._prefixes[-1] if self._prefixes else self.root
        self._prefixes += prefix_keys(parent, self.token_ids[done:], T)

    # -- writing -----------------------------------------------------------
    def length(self, layer: int = 0) -> int:
        return len(self.blocks[layer]) * self.layout.tokens + self.tail_len[layer]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append K/V ``[B, Hkv, t, D]`` of new tokens to ``layer``; full blocks go to the tiers."""
        T = self.layout.tokens
        done = 0
        while done < k.shape[2]:
            fill = self.tail_len[layer]
            take = min(T - fill, k.shape[2] - done)
            tk, tv = self._tail[layer]
            tk[:, :, fill:fill + take].copy_(k[:, :, done:done + take])
            tv[:, :, fill:fill + take].copy_(v[:, :, done:done + take])
            self.tail_len[layer] = fill + take
            done += take
            if self.tail_len[layer] == T:
                self._seal(layer)

    def _seal(self, layer: int) -> None:
        index = len(self.blocks[layer])
        key = self.block_key(layer, index)
        tk, tv = self._tail[layer]
        self.manager.put(key, self.layout.pack(tk, tv), layer=layer, index=index, persist=self.persist)
        self.blocks[layer].append(key)
        self.tail_len[layer] = 0

    def adopt(self, layer: int, key: BlockKey) -> None:
        """Take a block already stored (a reused prefix) as the next block of ``layer``."""
        if self.tail_len[layer]:
            raise ValueError(f"layer {layer}: cannot adopt a block after a partial tail")
        self.blocks[layer].append(key)

    def truncate(self, n_blocks: int) -> int:
        """Forget everything from block ``n_blocks`` on (in every layer); returns the new length.

        Used to recompute after a block was lost: the dropped blocks stay in
        the store as unprotected cache (or are gone already).
        """
        dropped = [k for layer in self.blocks for k in layer[n_blocks:]]
        self.manager.unprotect(dropped)
        self.blocks = [layer[:n_blocks] for layer in self.blocks]
        self.tail_len = [0] * self.layout.num_layers
        length = n_blocks * self.layout.tokens
        del self.token_ids[length:]
        del self._prefixes[n_blocks:]
        return length

    # -- reading -----------------------------------------------------------
    def tail(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.tail_len[layer]
        tk, tv = self._tail[layer]
        return tk[:, :, :n], tv[:, :, :n]

    def block_groups(self, layer: int, group: int) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Pinned K/V views of ``layer``'s sealed blocks, ``group`` blocks at a time.

        Yields ``(first_block_index, [(k, v), ...])``; the views are valid until
        the next iteration. The next group is prefetched while one is used.
        """
        keys = self.blocks[layer]
        for start in range(0, len(keys), group):
            if start + group < len(keys):
                self.manager.prefetch(keys[start + group:start + 2 * group], self.read_tier, layer=layer)
            with self.manager.blocks(keys[start:start + group], self.read_tier, layer=layer) as views:
                yield start, [self.layout.unpack(raw) for raw in views]

    def prefetch_layer(self, layer: int, limit: int, plan: PrefetchPolicy | None = None) -> None:
        """Start bringing blocks of ``layer`` into memory: those ``plan`` picks with room for ``limit``
        (default: the first ``limit``, which the reader reads first)."""
        blocks = self.blocks[layer]
        keys = blocks[:limit] if plan is None else plan.plan(layer, blocks, limit)
        if keys:
            self.manager.prefetch(keys, self.read_tier, layer=layer)

    def release(self, *, keep: bool) -> None:
        """The sequence is done: keep its blocks as reusable cache, or drop them everywhere."""
        keys = [k for layer in self.blocks for k in layer]
        if keep:
            self.manager.unprotect(keys)
        else:
            self.manager.drop(keys)
