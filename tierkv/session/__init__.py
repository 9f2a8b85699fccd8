"""Sessions: a document read once, asked many times; the library API of tierkv (``from tierkv import
Session``), and what ``tierkv run``, ``tierkv chat`` and ``tierkv serve`` are made of."""
from tierkv.session.generation import Answer, Sampling
from tierkv.session.session import Session
from tierkv.session.stream import Stream

__all__ = ["Answer", "Sampling", "Session", "Stream"]
