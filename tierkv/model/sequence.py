"""The KV of one sequence, kept in tierkv's tiers block by block.

Per layer, K and V of ``block_tokens`` consecutive tokens form one block
(``tierkv.model.layer_kv``). Sealed blocks live in the tier manager (held:
tierkv must not lose them); the newest, still-filling block stays in a tail::

    tokens   0 ........ 255 | 256 ....... 511 | 512 .. 600
    layer l  [ block l,0   ] [ block l,1     ] [ tail (89) ]   <- sealed blocks: tiers
    bytes    K[B,Hkv,T,D] then V[B,Hkv,T,D], padded to a multiple of 4096

Block keys are content addresses (see tierkv.keys) when the token ids are
known, so a later run over the same prefix finds the blocks again; without
token ids (a transformers cache sees only K/V) each block gets a key of its
own. A sequence forks (its branches share every sealed block) and crops.
"""
from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence

import torch

from tierkv.keys import BlockKey, layer_keys, prefix_keys, root_key
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.model.kv_buffer import BufferBudget
from tierkv.model.layer_kv import LayerKV
from tierkv.policy import PrefetchPolicy


class TieredSequence:
    """K/V of one sequence: per layer, sealed blocks in the tiers and a tail (``LayerKV``)."""

    def __init__(self, manager: BlockingTierManager, layout: BlockLayout, *, model_id: str | None = None,
                 persist: bool = False, budget: BufferBudget | None = None,
                 device: torch.device | str = "cpu") -> None:
        """``budget``: each layer keeps its K/V as one tensor on ``device`` while that has room
        (``LayerKV.contiguous``)."""
        self.manager = manager
        self.layout = layout
        self.persist = persist
        self.private = model_id is None     # no token ids: every sealed block gets a key of its own
        self.root = root_key(model_id, layout.name, str(layout.dtype)) if model_id else \
            BlockKey.of("private", os.urandom(16))
        self.token_ids: list[int] = []
        self._prefixes: list[BlockKey] = []   # prefix key of each full block of token_ids
        self.layers = [LayerKV(manager, layout, layer, budget=budget, device=device)
                       for layer in range(layout.num_layers)]

    @property
    def read_tier(self) -> str | None:
        """The tier blocks are read into (None: any memory tier, in place)."""
        return self.layers[0].read_tier

    @read_tier.setter
    def read_tier(self, tier: str | None) -> None:
        for state in self.layers:
            state.read_tier = tier

    @property
    def blocks(self) -> list[list[BlockKey]]:
        return [state.blocks for state in self.layers]

    # -- keys --------------------------------------------------------------
    def block_key(self, layer: int, index: int) -> BlockKey:
        """Key of block ``index`` of ``layer``: content-addressed once its tokens are known (a private
        sequence's blocks get keys of their own: branches of it must never share a key they seal)."""
        if self.private:
            return BlockKey.of(self.root.digest, os.urandom(8), layer, index)
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
        return self.layers[layer].length

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append K/V ``[B, Hkv, t, D]`` of new tokens to ``layer``; full blocks go to the tiers."""
        self.layers[layer].append(k, v, lambda index: self.block_key(layer, index), persist=self.persist)

    def adopt(self, layer: int, key: BlockKey) -> None:
        """Take a block already stored (a reused prefix) as the next block of ``layer``."""
        self.layers[layer].adopt(key)

    # -- branching -----------------------------------------------------------
    def fork(self) -> TieredSequence:
        """A branch of the same tokens: it holds every block too, and its tails are its own. BlockMissing
        where a block of it is stored nowhere any more (nothing then held)."""
        twin = copy.copy(self)
        twin.layers = []
        try:
            for state in self.layers:
                twin.layers.append(state.fork())
        except BaseException:            # (BlockMissing: a block lost) the layers forked so far let go
            for state in twin.layers:
                state.release(keep=True)
            raise
        twin.token_ids, twin._prefixes = list(self.token_ids), list(self._prefixes)
        return twin

    def crop(self, tokens: int) -> int:
        """Forget the last ``tokens`` tokens in every layer (a rejected draft, a step back); returns
        the new length. Blocks let go of stay as cache where the sequence persists its blocks."""
        for state in self.layers:
            state.crop(tokens, keep=self.persist)
        length = self.length()
        del self.token_ids[length:]
        del self._prefixes[length // self.layout.tokens:]
        return length

    def truncate(self, n_blocks: int) -> int:
        """Forget everything from block ``n_blocks`` on (in every layer); returns the new length.

        Used to recompute after a block was lost: the dropped blocks stay in
        the store as unprotected cache (or are gone already).
        """
        for state in self.layers:
            state.truncate(n_blocks, keep=True)
        length = n_blocks * self.layout.tokens
        del self.token_ids[length:]
        del self._prefixes[n_blocks:]
        return length

    # -- reading -----------------------------------------------------------
    def tail(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].tail()

    def contiguous(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s whole K/V as one tensor each, or None where it reads block by block
        (``LayerKV.contiguous``)."""
        return self.layers[layer].contiguous()

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V of every token, copied (``LayerKV.read``)."""
        return self.layers[layer].read()

    def reads_blocks(self, layer: int) -> bool:
        """A read of ``layer`` would load blocks from the tiers (none in its buffer yet, or not all)."""
        return self.layers[layer].reads_blocks

    def block_groups(self, layer: int, group: int) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Pinned K/V views of ``layer``'s sealed blocks, ``group`` blocks at a time (``LayerKV.groups``)."""
        return self.layers[layer].groups(group)

    def prefetch_layer(self, layer: int, limit: int, plan: PrefetchPolicy | None = None) -> None:
        """Start bringing blocks of ``layer`` into memory: those ``plan`` picks with room for ``limit``
        (default: the first ``limit``, which the reader reads first)."""
        blocks = self.layers[layer].blocks
        keys = blocks[:limit] if plan is None else plan.plan(layer, blocks, limit)
        if keys:
            self.manager.prefetch(keys, self.read_tier, layer=layer)

    def release(self, *, keep: bool) -> None:
        """The sequence is done: keep its blocks as reusable cache, or let go of them (a block no other
        sequence holds is dropped everywhere)."""
        for state in self.layers:
            state.release(keep=keep)
