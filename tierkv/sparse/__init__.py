"""Sparse attention over tiered KV (ShadowKV): low-rank keys, chunk landmarks, top-k value fetch."""
from tierkv.sparse.config import SparseConfig, parse_budget
from tierkv.sparse.engine import SparseEngine
from tierkv.sparse.pages import PageLayout
from tierkv.sparse.sequence import SparseSequence

__all__ = ["PageLayout", "SparseConfig", "SparseEngine", "SparseSequence", "parse_budget"]
