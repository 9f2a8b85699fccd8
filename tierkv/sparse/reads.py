"""What a sparse read of a layer's pages gives back: the chosen tokens' keys and values, and, for a
split read (``SparseConfig.overlap``), a ``Loading`` that brings the rows of the pages still loading.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from tierkv.layout import Blocks
from tierkv.manager.read_future import ReadFuture
from tierkv.sparse.order import Placed


class Loading:
    """The chunk tokens of a ``gather_split`` whose pages were still loading when it returned::

        k, v, pos, loading = seq.gather_split(layer, chunks)
        attend to the rows where not loading.missing        (the missing ones are zeros)
        at, valid, k2, v2 = loading.finish()                 waits; the missing rows' keys and values
        attend to those

    ``finish`` returns them per KV head, padded to the largest count: ``at`` [Hkv, m] (rows of
    the gathered K, V), ``valid`` [Hkv, m] (False: padding), keys and values [Hkv, m, D] (as ``gather``).
    """

    def __init__(self, missing: Tensor, finish: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]],
                 abandon: Callable[[], None]) -> None:
        self.missing = missing          # [Hkv, M] bool, in the order of the gathered rows
        self._finish, self._abandon = finish, abandon
        self.done = False

    def finish(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.done:
            raise RuntimeError("Loading.finish: already finished or abandoned")
        self.done = True
        return self._finish()

    def abandon(self) -> None:
        """Not going to ``finish`` (an error on the way): the pages are released when they arrive."""
        if not self.done:
            self.done = True
            self._abandon()


@dataclass(slots=True)
class LayerRead:
    """A layer's chunks read from their pages into keys and values [Hkv, width, D], where ``place``
    says (the rows of no chunk are the caller's), and, for a split read, the pages still loading
    into ``blocks``."""
    k: Tensor
    v: Tensor
    place: Placed
    blocks: Blocks | None              # the pages, each in its row (a split read's: copied out)
    future: ReadFuture | None
    loading: Tensor | None = None      # [pages] bool: still loading into blocks
