"""``TieredCache``: a transformers ``Cache`` whose KV lives in tierkv's tiers.

Pass it as ``cache=`` to ``model(...)`` or ``model.generate(...)``::

    with TieredCache(model.config, gpu="64MiB", cpu="256MiB", nvme_dir="/mnt/nvme/kv") as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=64)

Each layer keeps one ``LayerKV`` per batch row (sealed blocks of ``block_tokens`` tokens in the
tiers, a tail in memory). transformers' attention needs a layer's whole K/V as one tensor: each
layer keeps it in a buffer that only appends (``tierkv.model.kv_buffer``), on the compute device,
while the buffers fit ``buffer`` bytes (default: as much as ``gpu``); a layer past that gathers its
blocks into a fresh tensor each step while the next layer's are prefetched. Either way the values
are bit-identical to what ``DynamicCache`` returns (with ``kv_dtype="int8"`` the sealed blocks are
stored quantized: lossy, about half the bytes of bf16 KV, a quarter of fp32), and the blocks sit in the tiers
under their budgets.
Rows branch without copying KV, which is what beam search and assisted decoding need::

    reorder_cache(beam_idx)          row i := row beam_idx[i]: a row kept twice is forked (its
    batch_select_indices / _repeat   blocks held once more, its tail copied), a row dropped lets go
    crop(-n)                         the last n tokens of every row: a rejected draft
    fork() / copy.deepcopy(cache)    a second cache of the same tokens (a prompt's cache reused)

Importing this module also registers an attention implementation, ``"tierkv"``
(``model.set_attn_implementation("tierkv")``): transformers' ``sdpa``, except that a decode step of a
GQA layer folds its query heads onto their KV heads. Without a mask (any unpadded cache but a static
one) transformers sends a decode step through SDPA's ``enable_gqa`` path, which on a CPU in bf16 is
~6x slower; with it a SmolLM2 step at 4K takes 82 ms instead of 140 (the same tokens).
"""
from __future__ import annotations

import contextlib
import copy
import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tierkv.codec import block_codec
from tierkv.config import TierConfig, store_dir
from tierkv.errors import ConfigError, ManagerClosed
from tierkv.keys import BlockKey
from tierkv.layout import BlockLayout
from tierkv.manager import BlockingTierManager
from tierkv.model.kv_buffer import BufferBudget
from tierkv.model.layer_kv import LayerKV
from tierkv.sizes import parse_size
from tierkv.tiers.nvme_share import prepare_store_dir


class TieredLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: TieredCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.rows: list[LayerKV] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.owner._open(key_states)
        self.rows = [self.owner._new_row(self.index, key_states.device) for _ in range(key_states.shape[0])]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.rows):
            raise ValueError(f"layer {self.index}: {key_states.shape[0]} batch rows, the cache holds {len(self.rows)}")
        key_of = self.owner._key_of(self.index)
        for b, row in enumerate(self.rows):
            row.append(key_states[b:b + 1], value_states[b:b + 1], key_of, persist=False)
        self.owner._prefetch_after(self.index)
        return self.owner._gather(self.rows, key_states.device)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.rows[0].length if self.rows else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for row in self.rows:
            row.release(keep=False)
        self.rows, self.is_initialized = [], False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        for row in self.rows:
            row.crop(min(-tokens_to_remove, row.length), keep=False)     # (more than it holds: empty, as DynamicCache)

    # a layer that never took KV (one whose model shares another layer's) has no rows to pick from
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.rows:
            self.rows = select_rows(self.rows, beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows:
            self.rows = select_rows(self.rows, [b for b in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """``indices``: row numbers, or a mask of the rows kept."""
        picked = torch.as_tensor(indices)
        if picked.dtype == torch.bool:
            picked = picked.nonzero().flatten()
        if self.rows:
            self.rows = select_rows(self.rows, picked.tolist())


def select_rows(rows: list[LayerKV], order: Sequence[int]) -> list[LayerKV]:
    """``[rows[i] for i in order]`` without copying KV: a row's first use is the row itself, each
    further use a fork (blocks held once more, tail copied); a row not used lets go of its blocks."""
    used: set[int] = set()
    picked = []
    for i in order:
        picked.append(rows[i].fork() if i in used else rows[i])
        used.add(i)
    for i, row in enumerate(rows):
        if i not in used:
            row.release(keep=False)
    return picked


class TieredCache(Cache):
    """A transformers cache over tierkv tiers; close it (or use ``with``) to free its blocks."""

    def __init__(self, config: Any, *, gpu: str | int = "256MiB", cpu: str | int = "1GiB",
                 nvme_dir: str | Path | None = None, nvme_budget: str | int = "64GiB",
                 block_tokens: int = 256, kv_dtype: str | None = None, buffer: str | int | None = None,
                 manager: BlockingTierManager | None = None) -> None:
        """``buffer``: bytes the layers' contiguous K/V buffers may take on the compute device (default:
        ``gpu``; 0: none, every step gathers every layer's blocks). ``nvme_dir``: the store goes in a
        folder of it named by the block layout, so caches of other models or ``kv_dtype`` share it."""
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not isinstance(getattr(text_config, "num_hidden_layers", None), int):
            raise ConfigError(f"config: expected the model's transformers config (model.config), got "
                              f"{type(config).__name__}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, numbers.Integral) or block_tokens < 1:
            raise ConfigError(f"block_tokens={block_tokens!r}: expected an integer >= 1")
        if kv_dtype is not None and not isinstance(kv_dtype, str):
            raise ConfigError(f"kv_dtype={kv_dtype!r}: expected a name such as 'int8' or 'int4', or None (blocks "
                              "kept as computed)")
        if nvme_dir is not None and manager is None:          # one that cannot hold a store fails here
            nvme_dir = store_dir(nvme_dir)
            prepare_store_dir(nvme_dir, f"nvme_dir={str(nvme_dir)!r}")
        block_tokens = int(block_tokens)
        self.num_layers = text_config.num_hidden_layers
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.num_layers)])
        self._budgets = dict(gpu=gpu, cpu=cpu, nvme_dir=nvme_dir, nvme_budget=nvme_budget)
        self.block_tokens = block_tokens
        try:
            self.codec = block_codec(kv_dtype, block_tokens)     # validated now, not at the first token
        except ConfigError as bad:
            raise ConfigError(f"kv_dtype={bad}") from None
        self.kv_dtype = kv_dtype
        self.buffers = BufferBudget(parse_size(gpu, "gpu") if buffer is None else parse_size(buffer, "buffer"))
        self.manager = manager
        self._owns_manager = manager is None
        self._sharers = [1]       # caches forked from one another share its manager: the last to close closes it
        self.layout: BlockLayout | None = None
        self._root = os.urandom(16)
        self.closed = False
        if manager is None:
            self._check_budgets(text_config)

    def _check_budgets(self, config: Any) -> None:
        """Budgets that cannot hold one block fail here, not at the first token: the block as the config
        gives it (in its dtype; where it names none, in 16 bits, the smallest the model may run in: the
        first token checks again with the real one)."""
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        dtype = getattr(config, "dtype", None) or torch.bfloat16
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if isinstance(kv_heads, int) and isinstance(head_dim, int) and isinstance(dtype, torch.dtype):
            TierConfig(block_bytes=self._layout(kv_heads, head_dim, dtype).block_bytes, **self._budgets)

    def _layout(self, kv_heads: int, head_dim: int, dtype: torch.dtype) -> BlockLayout:
        try:
            return BlockLayout.kv(self.num_layers, kv_heads, head_dim, dtype, self.block_tokens, codec=self.codec)
        except ConfigError as bad:     # a group that does not divide the model's heads
            raise ConfigError(f"kv_dtype={self.kv_dtype!r}: {bad}") from None

    # -- called by the layers ---------------------------------------------
    def _open(self, key_states: torch.Tensor) -> None:
        if self.closed:
            raise ManagerClosed("this TieredCache was closed (its blocks are freed): make a new one")
        if self.layout is not None:
            return
        _, Hkv, _, D = key_states.shape
        self.layout = self._layout(Hkv, D, key_states.dtype)
        if self.manager is None:
            budgets = dict(self._budgets)
            if budgets["nvme_dir"] is not None:        # one store per block layout, as tierkv run keeps them
                budgets["nvme_dir"] = Path(budgets["nvme_dir"]) / self.layout.name
            config = TierConfig(block_bytes=self.layout.block_bytes, **budgets)
            self.manager = BlockingTierManager.from_config(config, namespace=self.layout.name)

    def _new_row(self, layer: int, device: torch.device) -> LayerKV:
        return LayerKV(self.manager, self.layout, layer, budget=self.buffers if self.buffers.limit else None,
                       device=device)

    def _key_of(self, layer: int):
        """Keys of the blocks rows seal: each its own (no token ids, and branches must never share one)."""
        return lambda index: BlockKey.of(self._root, os.urandom(8), layer, index)

    def _gather(self, rows: list[LayerKV], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        whole = [row.contiguous() for row in rows]
        if all(kv is not None for kv in whole):
            if len(whole) == 1:
                return whole[0]
            return torch.cat([k for k, _ in whole]), torch.cat([v for _, v in whole])
        T, (_, Hkv, _, D) = self.block_tokens, self.layout.fields[0].shape
        total = rows[0].length
        k = torch.empty(len(rows), Hkv, total, D, dtype=self.layout.dtype, device=device)
        v = torch.empty_like(k)
        for b, row in enumerate(rows):
            for first, blocks in row.groups(self.manager.pin_group()):
                for i, (bk, bv) in enumerate(blocks):
                    start = (first + i) * T
                    k[b:b + 1, :, start:start + T].copy_(bk)
                    v[b:b + 1, :, start:start + T].copy_(bv)
            tail_k, tail_v = row.tail()
            k[b:b + 1, :, total - tail_k.shape[2]:].copy_(tail_k)
            v[b:b + 1, :, total - tail_v.shape[2]:].copy_(tail_v)
        return k, v

    def _prefetch_after(self, layer: int) -> None:
        if layer + 1 < self.num_layers:
            keys = [key for row in self.layers[layer + 1].rows if row.reads_blocks
                    for key in row.blocks[:self.manager.pin_group()]]
            if keys:
                self.manager.prefetch(list(dict.fromkeys(keys))[:self.manager.pin_group()], layer=layer + 1)

    # -- branching -----------------------------------------------------------
    def fork(self) -> TieredCache:
        """A second cache of the same tokens that goes on on its own: every sealed block is shared (held
        once more) and each row's tail copied, so nothing of the KV is copied whole. ``copy.deepcopy``
        calls it, as transformers' recipe for reusing a prompt's cache does. Close each fork (one let go
        of unclosed lets go of its blocks when it is collected); the tiers they share are freed when the
        last one goes."""
        if self.closed:
            raise ManagerClosed("this TieredCache was closed (its blocks are freed): make a new one")
        twin = copy.copy(self)
        Cache.__init__(twin, layers=[TieredLayer(twin, i) for i in range(self.num_layers)])
        if self.manager is None:       # nothing computed yet: the fork opens tiers of its own
            twin._sharers, twin._root = [1], os.urandom(16)
            return twin
        try:
            for mine, theirs in zip(twin.layers, self.layers):
                if theirs.is_initialized:
                    mine.device, mine.is_initialized = theirs.device, True
                    for row in theirs.rows:
                        mine.rows.append(row.fork())
        except BaseException:
            for layer in twin.layers:
                for row in layer.rows:
                    row.release(keep=False)
            raise
        self._sharers[0] += 1
        return twin

    def __deepcopy__(self, memo: dict) -> TieredCache:
        return self.fork()

    def __del__(self) -> None:
        """A cache let go of unclosed (a fork ``copy.deepcopy`` made, as transformers' recipes drop them)
        lets go of its blocks, and the last of its forks to go closes the tiers they shared. Nothing here
        waits: a finalizer may run on the tiers' own loop thread, or as the interpreter exits."""
        if getattr(self, "closed", True) or getattr(self, "manager", None) is None:
            return
        self.closed, manager = True, self.manager
        self._sharers[0] -= 1
        manager.drop_later([key for layer in self.layers for row in layer.rows for key in row.blocks])
        if self._owns_manager and not self._sharers[0]:
            manager.close_later()

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for layer in self.layers:
            layer.reset()
        if self.manager is not None:
            self._sharers[0] -= 1
            if self._owns_manager and not self._sharers[0]:
                self.manager.close()
            self.manager = None

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- attention ---------------------------------------------------------------------------------
def folded_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, except for a decode step of a GQA layer: its one query token's
    heads are folded onto their KV heads (``[B, H, 1, D] -> [B, Hkv, G, D]``), one SDPA call with G query
    rows per KV head, instead of SDPA's ``enable_gqa`` path that transformers takes when there is no mask.
    On a CPU in bf16 that path is ~6x slower (2.5 ms against 0.4 ms a layer at 4K keys), which is what
    made a step with ``DynamicCache`` twice as long as one with ``StaticCache`` (whose mask takes the
    folded path). The same arithmetic as transformers' own folded call; every other case is its ``sdpa``."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, T, D = query.shape
    with _kernels_for(key):
        if T != 1 or groups == 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap"):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        folded = query.reshape(B, H // groups, groups, D)
        if attention_mask is not None and attention_mask.shape[1] != 1:   # a mask per query head: fold it too
            attention_mask = attention_mask.reshape(B, H // groups, groups, attention_mask.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                               scale=scaling)
    return out.reshape(out.shape[0], H, 1, D).transpose(1, 2).contiguous(), None


_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _kernels_for(key: torch.Tensor) -> contextlib.AbstractContextManager:
    """SDPA's kernels for ``key``. A TieredCache layer's K/V are views of a longer buffer (strided), and
    on CUDA cuDNN's attention plans such a view anew at every call: 5.1 ms of CPU a layer on an H200 at
    16K keys, against 0.1 ms for a packed K/V. Strided views go to flash, memory-efficient or math."""
    if key.is_cuda and not key.is_contiguous():
        return sdpa_kernel(_NOT_CUDNN)
    return contextlib.nullcontext()


ATTENTION = "tierkv"
"""The name ``folded_decode_attention`` is registered under: ``model.set_attn_implementation("tierkv")`` or
``from_pretrained(..., attn_implementation="tierkv")`` (once ``tierkv.hf`` is imported)."""
AttentionInterface.register(ATTENTION, folded_decode_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
