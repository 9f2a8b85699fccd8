"""Low-rank keys: a streaming SVD of a layer's pre-RoPE keys.

Keys of one layer, all KV heads side by side, form a tall matrix
``K [n, Hkv*D]`` with n up to millions of rows. Its right singular vectors
are the eigenvectors of the small Gram matrix ``K^T K [Hkv*D, Hkv*D]``, which
adds up chunk by chunk, so the SVD never holds K::

    G += k^T k                  for every chunk of keys k [t, Hkv*D]    (float64)
    B  = top-r eigenvectors(G)  [r, Hkv*D], orthonormal rows
    A  = K B^T                  [n, r]    the per-token factors, stored with the values
    K ~= A B                    exact when r = Hkv*D
    r = Hkv*D: B = I            the factors are the keys themselves; nothing to rebuild (pages
                                of quantized factors keep the eigenbasis: it quantizes better)

Keys are taken before RoPE: position rotations would spread them over
every dimension (ShadowKV's observation), and the rebuilt keys can then be
rotated to any position, including remapped ones.
"""
from __future__ import annotations

import torch
from torch import Tensor


class KeyBasis:
    """The Gram matrix of one layer's keys so far, and the basis fitted from it."""

    def __init__(self, key_dims: int) -> None:
        self.gram = torch.zeros(key_dims, key_dims, dtype=torch.float64)
        self.basis: Tensor | None = None      # [r, Hkv*D] float32
        self.energy_kept = 1.0                # share of the key energy inside the basis, at fit time
        self._exact_of: Tensor | None = None  # the basis ``exact`` last looked at, and what it found
        self._exact = False

    def add(self, keys: Tensor, *, sign: float = 1.0) -> None:
        """keys [t, Hkv*D] (pre-RoPE); ``sign=-1``: take them back out (a crop)."""
        k = keys.reshape(keys.shape[0], -1).double()
        self.gram.addmm_(k.T, k, alpha=sign)

    def fit(self, rank: int, *, rotate: bool = False) -> Tensor:
        """Fix the basis to the top ``rank`` directions of the keys added so far. At full rank it is the
        identity, unless ``rotate`` (quantized factors: the eigenbasis spreads the keys' outlier
        channels, and int8 codes lose less of them)."""
        dims = self.gram.shape[0]
        if rank >= dims and not rotate:
            self.basis, self.energy_kept = torch.eye(dims), 1.0
            return self.basis
        values, vectors = torch.linalg.eigh(self.gram)               # ascending
        top = vectors[:, -rank:].flip(1)                             # [Hkv*D, r], strongest first
        total = float(values.clamp(min=0).sum())
        self.energy_kept = float(values[-rank:].clamp(min=0).sum()) / total if total > 0 else 1.0
        self.basis = top.T.contiguous().float()
        return self.basis

    def copy(self) -> KeyBasis:
        twin = KeyBasis(self.gram.shape[0])
        twin.gram.copy_(self.gram)
        twin.basis, twin.energy_kept = self.basis, self.energy_kept
        return twin

    @property
    def exact(self) -> bool:
        """The basis is the identity: the factors are the keys (a basis stored by an older version
        at full rank is an orthonormal one, and is rebuilt through)."""
        basis = self.basis
        if basis is None or basis.shape[0] != basis.shape[1]:
            return False
        if self._exact_of is not basis:
            self._exact_of, self._exact = basis, bool(torch.equal(basis, torch.eye(basis.shape[0])))
        return self._exact

    @property
    def rank(self) -> int:
        return 0 if self.basis is None else self.basis.shape[0]


def project(keys: Tensor, basis: Tensor) -> Tensor:
    """keys [t, Hkv*D] -> factors [t, r]."""
    return keys.reshape(keys.shape[0], -1).float() @ basis.T


def reconstruct(factors: Tensor, basis: Tensor, heads: int, *, exact: bool = False) -> Tensor:
    """factors [t, r] -> keys [t, Hkv, D] (float32; ``exact``: the basis is the identity, and the keys
    are the factors, in their dtype)."""
    keys = factors if exact else factors.float() @ basis
    return keys.view(factors.shape[0], heads, -1)
