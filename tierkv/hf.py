"""``TieredCache``: a transformers ``Cache`` whose KV lives in tierkv's tiers.

Pass it as ``cache=`` to ``model(...)`` or ``model.generate(...)``::

    with TieredCache(model.config, gpu="64MiB", cpu="256MiB", nvme_dir="/mnt/nvme/kv") as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=64)

Each layer's K/V is appended to a ``TieredSequence`` (sealed 256-token
blocks in the tiers, a tail in memory). transformers' attention needs the
whole K/V of a layer as one tensor, so ``update`` gathers the blocks of that
layer into a fresh tensor, bit-identical to what ``DynamicCache`` returns,
while the next layer's blocks are prefetched. Only one layer's K/V is
materialised at a time; the rest sits in the tiers under their budgets.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tierkv.config import TierConfig
from tierkv.manager import BlockingTierManager
from tierkv.layout import BlockLayout
from tierkv.model.sequence import TieredSequence


class TieredLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, owner: TieredCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.owner._open(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seq = self.owner.sequence
        seq.append(self.index, key_states, value_states)
        self.owner._prefetch_after(self.index)
        return self.owner._gather(self.index, key_states.device)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        seq = self.owner.sequence
        return 0 if seq is None else seq.length(self.index)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("TieredCache cannot be reset; create a new one per sequence")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TieredCache does not support cropping (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TieredCache does not support beam search")


class TieredCache(Cache):
    """A transformers cache over tierkv tiers; close it (or use ``with``) to free its blocks."""

    def __init__(self, config: Any, *, gpu: str | int = "256MiB", cpu: str | int = "1GiB",
                 nvme_dir: str | Path | None = None, nvme_budget: str | int = "64GiB",
                 block_tokens: int = 256, manager: BlockingTierManager | None = None) -> None:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = text_config.num_hidden_layers
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.num_layers)])
        self._budgets = dict(gpu=gpu, cpu=cpu, nvme_dir=nvme_dir, nvme_budget=nvme_budget)
        self.block_tokens = block_tokens
        self.manager = manager
        self._owns_manager = manager is None
        self.sequence: TieredSequence | None = None

    # -- called by the layers ---------------------------------------------
    def _open(self, key_states: torch.Tensor) -> None:
        if self.sequence is not None:
            return
        B, Hkv, _, D = key_states.shape
        layout = BlockLayout.kv(self.num_layers, Hkv, D, key_states.dtype, self.block_tokens, B)
        if self.manager is None:
            config = TierConfig(block_bytes=layout.block_bytes, **self._budgets)
            self.manager = BlockingTierManager.from_config(config, namespace=layout.name)
        self.sequence = TieredSequence(self.manager, layout)

    def _gather(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.sequence
        T = self.block_tokens
        tail_k, tail_v = seq.tail(layer)
        B, Hkv, _, D = tail_k.shape
        total = seq.length(layer)
        k = torch.empty(B, Hkv, total, D, dtype=tail_k.dtype, device=device)
        v = torch.empty_like(k)
        for first, blocks in seq.block_groups(layer, self.manager.pin_group()):
            for i, (bk, bv) in enumerate(blocks):
                start = (first + i) * T
                k[:, :, start:start + T].copy_(bk)
                v[:, :, start:start + T].copy_(bv)
        sealed = len(seq.blocks[layer]) * T
        k[:, :, sealed:].copy_(tail_k)
        v[:, :, sealed:].copy_(tail_v)
        return k, v

    def _prefetch_after(self, layer: int) -> None:
        if layer + 1 < self.num_layers:
            self.sequence.prefetch_layer(layer + 1, self.manager.pin_group())

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        if self.sequence is not None:
            self.sequence.release(keep=False)
            self.sequence = None
        if self._owns_manager and self.manager is not None:
            self.manager.close()
            self.manager = None

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
