"""Sparse attention over tiered KV (ShadowKV): low-rank keys, chunk landmarks, top-k value fetch.

The mechanism lives here (settings, key basis, chunk index, pages, the
sequence, the stored index); ``tierkv.model.sparse_engine`` runs a model on it.
"""
from tierkv.sparse.config import SparseConfig, parse_budget
from tierkv.sparse.sequence import SparseSequence

__all__ = ["SparseConfig", "SparseSequence", "parse_budget"]
