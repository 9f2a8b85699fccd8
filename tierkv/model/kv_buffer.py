"""A layer's K/V as one contiguous tensor pair that only appends, so attention reads it in one call.

Sealed blocks live in the tiers, one ``block_bytes`` row each, in slots that follow no order. A
kernel wants a layer's keys as one tensor; gathering every block into a fresh one each step
copies the whole KV per step (the cost that also dominates transformers' ``DynamicCache``). A
``KVBuffer`` keeps that tensor between steps and only appends::

    buffer   [ block 0 | block 1 | ... | block n-1 | tail ]      capacity grows in blocks, by 1/8
    filled   tokens of sealed blocks copied in (a block is copied once: when it is sealed, or
             read once from the tiers when it was not: a reused prefix, a fork)

Every buffer takes its bytes from one ``BufferBudget``; a buffer that cannot grow gives its
bytes back and its layer reads block by block again. Room to grow is taken only within a buffer's
fair share of what the budget has left (its free bytes over the buffers holding some), so a budget
sized for every layer's KV never lets the first layers' growth room push the last ones out.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor


class BufferBudget:
    """Bytes that the working buffers of every layer and sequence may hold together."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"buffer budget {limit}: must be >= 0 bytes")
        self.limit, self.used, self.peak = limit, 0, 0
        self.holders = 0          # buffers holding some bytes
        self._lock = threading.Lock()

    def fair_share(self, needed: int = 0) -> int:
        """What is free besides the ``needed`` bytes, over the buffers holding some (the asker too): the
        most one may take as room to grow."""
        with self._lock:
            return max(0, self.limit - self.used - needed) // max(1, self.holders)

    def take(self, nbytes: int, *, first: bool = False) -> bool:
        """``nbytes`` more, if they fit; ``first``: the taker held none before."""
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.holders += first
            self.peak = max(self.peak, self.used)
            return True

    def give(self, nbytes: int, *, last: bool = False) -> None:
        """``nbytes`` back; ``last``: the giver holds none now."""
        with self._lock:
            self.used -= nbytes
            self.holders -= last


class KVBuffer:
    """K and V [B, Hkv, capacity, D] of one layer, valid for tokens [0, filled) plus what a read writes."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 budget: BufferBudget) -> None:
        self.rows, self.heads, self.block, self.dim = shape     # a block's K: [B, Hkv, T, D]
        self.dtype, self.device, self.budget = dtype, torch.device(device), budget
        self.k = self.v = torch.empty(self.rows, self.heads, 0, self.dim, dtype=dtype, device=self.device)
        self.filled = 0              # tokens of sealed blocks in place

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.nbytes

    def reserve(self, tokens: int) -> bool:
        """Room for ``tokens``; False (and the buffer emptied, its bytes given back) where the budget
        has none left."""
        if tokens <= self.capacity:
            return True
        per_token = 2 * self.rows * self.heads * self.dim * self.k.element_size()
        enough = -(-tokens // self.block) * self.block
        roomy = -(-max(tokens, self.capacity * 9 // 8) // self.block) * self.block
        share = self.budget.fair_share((enough - self.capacity) * per_token) // (per_token * self.block) * self.block
        roomy = min(roomy, enough + share)              # growth room within its share of what is free
        first = not self.capacity
        for grown in dict.fromkeys((roomy, enough)):
            if self.budget.take((grown - self.capacity) * per_token, first=first):
                break
        else:
            self.close()
            return False
        try:
            with torch.inference_mode(False):   # written to after an inference_mode() block too
                k = torch.empty(self.rows, self.heads, grown, self.dim, dtype=self.dtype, device=self.device)
                v = torch.empty_like(k)
        except BaseException:                           # out of device memory: the budget gets its bytes back
            self.budget.give((grown - self.capacity) * per_token, last=first)
            raise
        k[:, :, :self.filled].copy_(self.k[:, :, :self.filled])
        v[:, :, :self.filled].copy_(self.v[:, :, :self.filled])
        self.k, self.v = k, v
        return True

    def write(self, at: int, k: Tensor, v: Tensor) -> None:
        """Tokens [at, at + t) := k, v [B, Hkv, t, D] (room reserved)."""
        end = at + k.shape[2]
        self.k[:, :, at:end].copy_(k)
        self.v[:, :, at:end].copy_(v)

    def view(self, tokens: int) -> tuple[Tensor, Tensor]:
        return self.k[:, :, :tokens], self.v[:, :, :tokens]

    def close(self) -> None:
        if self.capacity:
            self.budget.give(self.nbytes, last=True)
        self.k = self.v = torch.empty(self.rows, self.heads, 0, self.dim, dtype=self.dtype, device=self.device)
        self.filled = 0
