"""tierkv: a tiered KV-cache offloading runtime for LLM inference.

The library's entry point is a session (``tierkv.session``)::

    from tierkv import Session

    with Session.open("smollm2", nvme_dir="/mnt/nvme/kv") as session:
        session.read(Path("report.txt"))
        print(session.ask("What are the three main findings?").text)

Names are imported on first use, so ``import tierkv`` stays cheap.
"""
from __future__ import annotations

from typing import Any

_API = {"Session": "tierkv.session", "Stream": "tierkv.session", "Answer": "tierkv.session",
        "Sampling": "tierkv.session", "SessionConfig": "tierkv.model.settings", "RunConfig": "tierkv.model.settings",
        "TieredCache": "tierkv.hf", "TierConfig": "tierkv.config", "SparseConfig": "tierkv.sparse"}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_API[name]), name)
