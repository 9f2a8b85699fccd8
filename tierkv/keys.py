"""Content addresses of KV blocks.

A block's key is a hash chain: the same model, layout, dtype and token prefix
always give the same keys, so a later run (or another document that shares
the prefix) finds the blocks it can reuse::

    root   = H("tierkv-v1" | model_id | layout | dtype)
    p[0]   = H(root  | tokens[0:n])          one prefix key per token block
    p[i]   = H(p[i-1] | tokens[i*n:(i+1)*n])
    key    = H(p[i] | layer)                 one block per (prefix, layer)

H is xxh3-128; keys are 16 raw bytes, shown as hex.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

KEY_BYTES = 16


class BlockKey(bytes):
    """A block's 16-byte digest. Hashing, equality and order are bytes' own, done in C: a
    directory of a million blocks looks keys up hundreds of thousands of times a decode step."""

    __slots__ = ()

    def __new__(cls, digest: bytes) -> BlockKey:
        if len(digest) != KEY_BYTES:
            raise ValueError(f"digest: {len(digest)} bytes, expected {KEY_BYTES}")
        return super().__new__(cls, digest)

    @property
    def digest(self) -> bytes:
        return bytes(self)

    @classmethod
    def many(cls, raw: bytes) -> list[BlockKey]:
        """The keys of ``raw``, digests back to back (a store's index: a million at once)."""
        if len(raw) % KEY_BYTES:
            raise ValueError(f"{len(raw)} bytes: not whole {KEY_BYTES}-byte digests")
        new = bytes.__new__
        return [new(cls, raw[at:at + KEY_BYTES]) for at in range(0, len(raw), KEY_BYTES)]

    @classmethod
    def of(cls, *parts: bytes | str | int) -> BlockKey:
        """A key hashed from arbitrary parts (tests, ad-hoc blocks)."""
        return cls(_hashed(parts).digest())

    @classmethod
    def series(cls, *parts: bytes | str | int, first: int = 0, count: int) -> list[BlockKey]:
        """``[BlockKey.of(*parts, i) for i in range(first, first + count)]``, the shared parts hashed
        once (a stored document's million page keys: 1 us a key instead of 3)."""
        prefix, new = _hashed(parts), bytes.__new__
        out = []
        for i in range(first, first + count):
            h = prefix.copy()
            h.update(_INT_PART + i.to_bytes(8, "little", signed=True))
            out.append(new(cls, h.digest()))
        return out

    def __repr__(self) -> str:
        return f"BlockKey({self.hex()[:12]})"

    __str__ = __repr__


_INT_PART = (8).to_bytes(8, "little")     # an int part: its length, then its 8 bytes


def _hashed(parts: Iterable[bytes | str | int]) -> xxhash.xxh3_128:
    h = xxhash.xxh3_128()
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        raw = raw.to_bytes(8, "little", signed=True) if isinstance(raw, int) else raw
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h


def root_key(model_id: str, layout: str, dtype: str) -> BlockKey:
    return BlockKey.of("tierkv-v1", model_id, layout, dtype)


def prefix_keys(root: BlockKey, token_ids: Sequence[int], block_tokens: int) -> list[BlockKey]:
    """One key per *full* block of ``block_tokens`` tokens (a partial tail gets none)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    keys: list[BlockKey] = []
    parent = root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = BlockKey.of(parent.digest, tokens[start:start + block_tokens].tobytes())
        keys.append(parent)
    return keys


def layer_keys(prefix: BlockKey, layers: Iterable[int]) -> list[BlockKey]:
    return [BlockKey.of(prefix.digest, "layer", layer) for layer in layers]
