"""What a trace says to act on: step latency, where the stall came from, links against their limits.

Everything is computed over one phase of the run: ``decode`` (inside the
``step`` slices, the default), ``prefill`` or ``all``; `tierkv.profile.summary_text`
writes the result as text. Definitions:

stall          time a reader waited for blocks (``wait`` events).
attribution    which tier links a wait was blocked behind (`tierkv.profile.attribution`).
achieved GB/s  bytes a link moved / the time it was busy (the union of its transfers' intervals),
               next to the link's measured limit from the trace's metadata (``link_limit``).
reads          where the blocks readers acquired came from: found in place in a memory tier
               (``hit`` events), or missing at the first attempt (a wait's ``blocks``) and then
               loaded from a lower tier (``load`` events) or taken from a prefetch still in flight.
               The hit rate of a tier is its in-place share of all blocks acquired.
reuse          1 - blocks brought into memory from storage during the phase (loads and prefetches
               from the nvme tier) / blocks acquired in it: the share of reads carried
               over from earlier steps. A lower bound: a prefetched block nobody read still counts as
               brought in. Moves between memory tiers (cpu->gpu) bring nothing new.
modelled       what a simulated CXL pool charged (tierkv.tiers.cxl_link, cxl_pnm), one row per
               kind and place: ``link`` (bytes streaming plus load-to-use latency), ``queue`` (a
               request or a near-memory command waiting for its channel or processor) and
               ``compute`` (the near-memory processor). These slices sit inside the transfers and
               selections that caused them, so they are reported apart and never added to the
               link table above.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from tierkv.errors import ConfigError
from tierkv.events import COMPUTE_KINDS, MODELLED_KINDS, Event, EventKind, busy_seconds
from tierkv.profile.attribution import INTO_MEMORY, UNATTRIBUTED, TransferIndex, attribute

PHASES = ("decode", "prefill", "all")
STORAGE_TIERS = ("nvme",)     # tiers that are not memory: a read from them brings a block into memory


@dataclass(frozen=True, slots=True)
class Share:
    """One row of a stall table: a tier link or a layer."""

    key: str
    seconds: float
    waits: int
    of_stall: float
    of_time: float          # of the phase's time (links) or of the layer's own time (layers)


@dataclass(frozen=True, slots=True)
class Cause:
    link: str
    layer: int | None
    seconds: float
    waits: int
    of_stall: float
    kinds: dict[str, float]   # seconds per transfer kind (load, prefetch, demote)

    def describe(self) -> str:
        kind = max(self.kinds, key=self.kinds.get) if self.kinds else ""
        what = {"load": "loads", "prefetch": "late prefetches", "demote": "demotes"}.get(kind, "waits")
        where = "" if self.layer is None else f" at layer {self.layer}"
        return (f"{self.link} {what}{where}: {100 * self.of_stall:.0f} % of stall "
                f"({self.waits} waits, mean {1e3 * self.seconds / max(self.waits, 1):.1f} ms)")


@dataclass(frozen=True, slots=True)
class Link:
    link: str
    kinds: str
    transfers: int
    nbytes: int
    busy_s: float
    gbps: float
    limit_gbps: float | None


@dataclass(frozen=True, slots=True)
class Source:
    """Where acquired blocks came from: ``in place in gpu``, ``loaded from nvme``, ..."""

    source: str
    blocks: int
    share: float


@dataclass(frozen=True, slots=True)
class Modelled:
    """One row of what a simulated pool charged: ``link cxl->gpu``, ``queue host->cxl``, ``compute cxl``."""

    kind: str
    where: str
    count: int
    nbytes: int
    seconds: float      # summed over the slices
    busy_s: float       # the union of their intervals
    of_phase: float     # busy_s / the phase's time


@dataclass(slots=True)
class Summary:
    phase: str
    phase_s: float
    steps: int
    step_ms: dict[str, float]
    prefill_s: float
    stall_s: float
    waits: int
    by_link: list[Share]
    by_layer: list[Share]
    causes: list[Cause]       # every (link, layer), largest first
    links: list[Link]
    reads: list[Source]
    reuse: float | None
    tiers: dict[str, dict] = field(default_factory=dict)   # the run's tier report, from the trace's metadata
    notes: list[str] = field(default_factory=list)
    modelled: list[Modelled] = field(default_factory=list)  # a simulated CXL pool's link, queue, compute

    @property
    def phase_time(self) -> str:
        return "the run" if self.phase == "all" else f"{self.phase} time"

    @property
    def stall_fraction(self) -> float:
        return self.stall_s / self.phase_s if self.phase_s else 0.0

    def as_dict(self, top: int = 5) -> dict[str, object]:
        return asdict(self) | {"stall_fraction": self.stall_fraction,
                               "top_causes": [c.describe() for c in self.causes[:top]]}


# -- phases ----------------------------------------------------------------
class _Window:
    """The phase's time as sorted, disjoint (start, done) spans; ``holds`` asks if a time is in one."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        self.spans = sorted(spans)
        self.starts = [a for a, _ in self.spans]
        self.seconds = sum(b - a for a, b in self.spans)

    def holds(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.spans[i][1]


def _window(events: Sequence[Event], phase: str) -> _Window:
    if phase == "all":
        return _Window([(min(e.start for e in events), max(e.done for e in events))])
    kind = "step" if phase == "decode" else "prefill"
    return _Window([(e.start, e.done) for e in events if e.kind == kind])


# -- the summary -------------------------------------------------------------
def summarize(events: Sequence[Event], meta: dict | None = None, *, phase: str = "decode") -> Summary:
    """Summarize recorded (or read-back) events; ``meta`` is the trace's "tierkv" object."""
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r}: allowed: {', '.join(PHASES)}")
    if not events:
        raise ConfigError("no events to summarize")
    meta, notes = meta or {}, []
    if isinstance(meta.get("partial"), str):
        notes.append(f"the run stopped before its end ({meta['partial']}): the trace holds what it did until then")
    if phase == "decode" and not any(e.kind == EventKind.STEP for e in events):
        notes.append("the trace has no decode steps: summarizing the whole run")
        phase = "all"
    window = _window(events, phase)
    inside = [e for e in events if window.holds(e.start)]
    waits = [e for e in inside if e.kind == EventKind.WAIT]
    transfers = TransferIndex(events)
    charged = [(w, attribute(w, transfers)) for w in waits]
    stall = sum(w.done - w.start for w in waits)
    steps = [e.done - e.start for e in events if e.kind == EventKind.STEP]
    reads, reuse = _reads(inside, notes)
    summary = Summary(phase, window.seconds, len(steps), _percentiles(steps),
                      sum(e.done - e.start for e in events if e.kind == EventKind.PREFILL), stall, len(waits),
                      _by_link(charged, stall, window.seconds), _by_layer(waits, inside, stall),
                      _causes(charged, stall), _links(inside, meta), reads, reuse,
                      _mapping(meta, "tiers"), notes, _modelled(inside, window.seconds))
    _note_gaps(summary, charged, meta)
    return summary


def _percentiles(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    ms = np.asarray(seconds) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean()), "max": float(ms.max())}


def _by_link(charged: list[tuple[Event, dict]], stall: float, phase_s: float) -> list[Share]:
    seconds: dict[str, float] = defaultdict(float)
    waits: dict[str, set[int]] = defaultdict(set)
    for i, (_, parts) in enumerate(charged):
        for (link, _), s in parts.items():
            seconds[link] += s
            waits[link].add(i)
    return sorted((Share(link, s, len(waits[link]), s / stall if stall else 0.0,
                         s / phase_s if phase_s else 0.0) for link, s in seconds.items()),
                  key=lambda r: -r.seconds)


def _by_layer(waits: list[Event], inside: list[Event], stall: float) -> list[Share]:
    layer_s: dict[int | None, float] = defaultdict(float)
    for e in inside:
        if e.kind == EventKind.LAYER:
            layer_s[e.layer] += e.done - e.start
    stalled: dict[int | None, list[float]] = defaultdict(list)
    for w in waits:
        stalled[w.layer].append(w.done - w.start)
    rows = [Share("-" if layer is None else str(layer), sum(s), len(s), sum(s) / stall if stall else 0.0,
                  sum(s) / layer_s[layer] if layer_s.get(layer) else 0.0) for layer, s in stalled.items()]
    return sorted(rows, key=lambda r: -r.seconds)


def _causes(charged: list[tuple[Event, dict]], stall: float) -> list[Cause]:
    seconds: dict[tuple[str, int | None], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    waits: dict[tuple[str, int | None], int] = defaultdict(int)
    for w, parts in charged:
        for (link, kind), s in parts.items():
            seconds[(link, w.layer)][kind] += s
        for link in {link for link, _ in parts}:
            waits[(link, w.layer)] += 1
    rows = [Cause(link, layer, sum(kinds.values()), waits[(link, layer)],
                  sum(kinds.values()) / stall if stall else 0.0, {k: v for k, v in kinds.items() if k})
            for (link, layer), kinds in seconds.items()]
    return sorted(rows, key=lambda c: -c.seconds)


def _links(inside: list[Event], meta: dict) -> list[Link]:
    groups: dict[str, list[Event]] = defaultdict(list)
    for e in inside:
        if e.kind not in (EventKind.WAIT, EventKind.HIT, *COMPUTE_KINDS, *MODELLED_KINDS) and e.nbytes:
            groups[f"{e.src or 'new'}->{e.dst}"].append(e)
    limits = _mapping(meta, "links")
    rows = []
    for link, group in groups.items():
        busy = busy_seconds([(e.start, e.done) for e in group])
        nbytes = sum(e.nbytes for e in group)
        rows.append(Link(link, ",".join(sorted({e.kind for e in group})), len(group), nbytes, busy,
                         nbytes / busy / 1e9 if busy else 0.0, link_limit(link, limits)))
    return sorted(rows, key=lambda r: -r.nbytes)


def _modelled(inside: list[Event], phase_s: float) -> list[Modelled]:
    groups: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for e in inside:
        if e.kind in MODELLED_KINDS:
            where = e.src if e.src == e.dst else f"{e.src or 'new'}->{e.dst}"
            groups[(e.kind, where)].append(e)
    rows = []
    for (kind, where), group in groups.items():
        busy = busy_seconds([(e.start, e.done) for e in group])
        rows.append(Modelled(kind, where, len(group), sum(e.nbytes for e in group),
                             sum(e.done - e.start for e in group), busy, busy / phase_s if phase_s else 0.0))
    return sorted(rows, key=lambda r: (MODELLED_KINDS.index(r.kind), -r.busy_s))


def link_limit(link: str, limits: dict[str, object]) -> float | None:
    """GB/s limit of ``src->dst`` from the trace's "links": a number or a probe record ({"gbps": ...}).

    A link the probe did not measure directly (nvme->gpu) is staged through host memory: the
    slower of its two hops (nvme->cpu, cpu->gpu) bounds it.
    """
    def gbps(name: str) -> float | None:
        value = limits.get(name)
        value = value.get("gbps") if isinstance(value, dict) else value
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    direct = gbps(link)
    if direct is not None:
        return direct
    src, _, dst = link.partition("->")
    hops = [gbps(f"{src}->cpu"), gbps(f"cpu->{dst}")]
    return None if None in hops or "cpu" in (src, dst) else min(hops)


def _mapping(meta: dict, name: str) -> dict:
    """``meta[name]`` when it is an object; metadata is advisory, a malformed entry is ignored."""
    value = meta.get(name)
    return dict(value) if isinstance(value, dict) else {}


def _reads(inside: list[Event], notes: list[str]) -> tuple[list[Source], float | None]:
    hits = [e for e in inside if e.kind == EventKind.HIT]
    if not hits:
        notes.append("hit rates and reuse need `hit` events (blocks an acquire found in place); "
                     "this trace has none")
        return [], None
    counts: dict[str, int] = defaultdict(int)
    for e in hits:
        counts[f"in place in {e.dst}"] += e.blocks
    missed = sum(e.blocks for e in inside if e.kind == EventKind.WAIT)
    loaded = 0
    for e in inside:
        if e.kind == EventKind.LOAD:
            counts[f"loaded from {e.src}"] += e.blocks
            loaded += e.blocks
    if missed > loaded:
        counts["taken from a prefetch in flight"] = missed - loaded
    acquired = sum(e.blocks for e in hits) + missed
    reads = [Source(s, n, n / acquired) for s, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    brought = sum(e.blocks for e in inside if e.kind in INTO_MEMORY and e.src in STORAGE_TIERS)
    if brought > acquired:
        notes.append(f"the steps acquired {acquired} blocks and {brought} came in from storage (loads and "
                     f"prefetches): prefetches brought at least {brought - acquired} blocks no step read")
    return reads, max(0.0, 1.0 - brought / acquired) if acquired else None


def _note_gaps(s: Summary, charged: list[tuple[Event, dict]], meta: dict) -> None:
    lost = sum(p.get((UNATTRIBUTED, ""), 0.0) for _, p in charged)
    if s.stall_s and lost / s.stall_s > 0.05:
        s.notes.append(f"{100 * lost / s.stall_s:.0f} % of stall overlapped no transfer into the waiting "
                       "tier (blocked on a pin or on the executor queue?)")
    if s.links and not _mapping(meta, "links"):
        s.notes.append("no measured link limits in the trace: GB/s is shown without its limit (`tierkv info "
                       "--probe --nvme-dir DIR` measures this machine's links once; later runs record them)")
    elif unmeasured := [link.link for link in s.links if link.limit_gbps is None and not link.link.startswith("new->")]:
        disk = " (the disk's links: `tierkv info --probe --nvme-dir DIR` with the run's --nvme-dir)" \
            if any("nvme" in link for link in unmeasured) else ""
        s.notes.append(f"no measured limit for {', '.join(unmeasured)}{disk}")
