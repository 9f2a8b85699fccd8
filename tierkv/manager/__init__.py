"""Control plane: where each block lives and how it moves between tiers."""
from tierkv.manager.blocking import BlockingTierManager
from tierkv.manager.manager import Lease, TierManager
from tierkv.manager.transfer import Kind, Priority, Transfer

__all__ = ["BlockingTierManager", "Kind", "Lease", "Priority", "TierManager", "Transfer"]
