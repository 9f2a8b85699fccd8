"""``near-memory``: ShadowKV's landmark selection, executed by the CXL pool's near-memory processor.

Same chunks as ``shadowkv`` (the same math on the same landmarks), but the
landmarks live in the simulated pool and are scored there; per layer and
step only the query crosses the link in and the chosen ids come back (see
`tierkv.tiers.cxl_pnm`)::

    engine ── select(q, view, k) ──▶ NearMemorySelector
                                        store(view.layer, view.landmarks, view.candidates)   new rows only
                                        select(view.layer, q, k)                             q in, ids out

``policies.selectors.make_selector("near-memory")`` builds its own processor behind a
``cxl2-x8`` link with the ``pnm-ocp25`` processor; ``link=`` and ``pnm=``
choose other presets (or pass a cxl tier's ``tier.link`` so selections and
block moves share one link). ``stats`` reads bytes across the link, compute
and queue seconds; ``attach(recorder)`` puts its slices in a run's trace.

The selector is the CXL tier's capability, so it lives with the tier; ``policies.selectors``
names it by path (``near-memory``) and imports nothing of the tiers.
"""
from __future__ import annotations

from torch import Tensor

from tierkv.events import EventRecorder
from tierkv.policy import ChunkView
from tierkv.scoring import landmark_values
from tierkv.tiers.cxl_link import CxlLink, Direction, LinkSpec
from tierkv.tiers.cxl_pnm import NearMemoryProcessor, PnmSpec


class NearMemorySelector:
    needs: frozenset[str] = frozenset({"landmarks"})

    def __init__(self, link: CxlLink | LinkSpec | str = "cxl2-x8", pnm: PnmSpec | str = "pnm-ocp25",
                 processor: NearMemoryProcessor | None = None) -> None:
        self.processor = processor or NearMemoryProcessor(link, pnm)

    def select(self, query: Tensor, view: ChunkView, k: int) -> Tensor:
        if view.landmarks is None:
            raise ValueError(f"layer {view.layer}: the near-memory selector scores landmarks; "
                             "the index kept none (build it with needs={'landmarks'})")
        self.processor.store(view.layer, landmark_values(view.landmarks, view.landmark_scale), view.candidates)
        return self.processor.select(view.layer, query, k)

    def bind(self, manager) -> None:
        """Run inside a tier manager: share its CXL pool's link when it has one, record into its events."""
        pool = manager.tiers.get("cxl")
        if pool is not None:
            self.processor = NearMemoryProcessor(pool.link, self.processor.spec)
        self.attach(manager.events)

    def attach(self, recorder: EventRecorder) -> None:
        self.processor.attach(recorder)

    @property
    def stats(self) -> dict[str, float]:
        """Bytes across the link (each way), processor seconds, queue seconds (link and processor)."""
        link, pnm = self.processor.link.stats, self.processor.stats
        return {"link_write_bytes": link.nbytes[Direction.WRITE],
                "link_read_bytes": link.nbytes[Direction.READ],
                "link_s": link.link_s, "compute_s": pnm.compute_s, "queue_s": link.queue_s + pnm.queue_s,
                "selections": pnm.commands, "mirrored_bytes": pnm.mirrored_bytes}

