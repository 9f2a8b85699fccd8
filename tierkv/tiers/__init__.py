"""Tiers own bytes and I/O; they know no policy. See base.py for the contract."""
from tierkv.tiers.base import ArenaTier, Medium, Tier
from tierkv.tiers.pool import BlockPool, SlotState

__all__ = ["ArenaTier", "BlockPool", "Medium", "SlotState", "Tier"]
