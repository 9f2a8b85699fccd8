"""Trace replay: eviction and prefetch policies run over a recorded access trace, without the model.

The replay drives the real `TierManager` (placement, eviction, demotion,
write-back, joining moves in flight, and the eviction policies under test)
over a simulated machine (`tierkv.tune.simulation`): tiers that keep no
bytes, an executor whose transfers complete when the tier model
(`tierkv.tune.tier_model`) says, not when a worker thread finishes, and an
event loop whose clock is virtual. Same priority queue, same limits on
transfers and bytes in flight as a run::

    trace ──▶ driver ──put / acquire / prefetch──▶ TierManager (the real one)
     (calls, compute between them)                    │ transfers
                                                      ▼
                                 Executor + ModelledRunner ──▶ TierModel ──▶ completion at virtual t

The driver (`tierkv.tune.driver`) plays each op at its virtual time, the
run's own compute between ops scaled by ``compute_scale``; the stall is the
sum over gets of the time the manager took to return (puts are counted
apart). Prefetches (`tierkv.tune.prefetchers`, named as ``tierkv run`` names
them for the engine that recorded the trace) are issued before the op they
are planned at, as that engine would have issued them.

A block the trace reads before it ever stores it was stored before the
recording began: it starts in the store, as a reopened NVMe store's blocks do.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from policies import make_policy
from tierkv.errors import ConfigError
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.knobs import IOKnobs
from tierkv.manager.executor import Executor
from tierkv.manager.manager import TierManager
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import STEP_KINDS, AccessTrace, OpKind
from tierkv.profile.link_stats import link_bytes
from tierkv.tiers.base import Medium
from tierkv.tiers.cxl_link import link_spec
from tierkv.tune.driver import Driver, block_key, compute_gaps
from tierkv.tune.prefetchers import check_prefetch, plan_prefetch, resolve_prefetch
from tierkv.tune.simulation import ModelledRunner, SimArena, SimStore, VirtualLoop
from tierkv.tune.tier_model import TierModel


# -- configuration and result -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReplayConfig:
    policies: Mapping[str, str] = field(default_factory=dict)  # tier -> eviction policy (default: the trace's)
    prefetch: str | None = None                                # a tierkv run prefetcher name (see
                                                               # tune.prefetchers); None: the engine's default
    slots: Mapping[str, int] = field(default_factory=dict)     # tier -> budget in blocks (default: the trace's)
    compute_scale: float | Mapping[str, float] = 1.0           # the trace's compute times x this, or per step
                                                               # kind: {"prefill": x, "decode": y} (what-if)
    cxl_preset: str = "cxl2-x8"                                # prices a cxl tier the model does not name

    def __post_init__(self) -> None:
        check_prefetch(self.prefetch)   # whether it fits the trace's engine is checked at replay
        link_spec(self.cxl_preset)  # an unknown preset fails here, naming the valid ones
        scales = self.scales()
        if set(scales) != set(STEP_KINDS) or not all(isinstance(v, int | float) and v > 0 for v in scales.values()):
            raise ConfigError(f"compute_scale={self.compute_scale!r}: a factor > 0, or one per step kind "
                              f"({', '.join(STEP_KINDS)})")
        bad = {k: v for k, v in self.slots.items() if not (isinstance(v, int) and v >= 1)}
        if bad:
            raise ConfigError(f"slots={bad}: a tier's budget must be at least 1 block")

    def scales(self) -> dict[str, float]:
        scale = self.compute_scale
        return dict(scale) if isinstance(scale, Mapping) else {kind: scale for kind in STEP_KINDS}

    def scale_per_op(self, trace: AccessTrace) -> np.ndarray:
        factors = np.array([self.scales()[kind] for kind in STEP_KINDS])
        return factors[trace.step_kind[trace.op_step]] if trace.n_steps else np.ones(trace.n_ops)


@dataclass(slots=True)
class ReplayResult:
    policies: dict[str, str]
    prefetch: str
    bytes_by_link: dict[str, int]          # "src->dst"; "new->t": blocks the caller put into t
    served: dict[str, int]                 # blocks the gets found in each tier (+ arriving, nowhere)
    hit_rates: dict[str, float]            # per tier, of the blocks not found in a faster one
    stall_s: float                         # modelled seconds the reader waited in gets
    decode_stall_s: float
    put_s: float                           # ... and in puts
    compute_s: float                       # the trace's own time between calls
    total_s: float                         # first step to the end of the last call
    trace: AccessTrace | None = None       # what the replayed manager saw: ``where`` per block, modelled
                                           # ``op_time`` (virtual) and ``op_blocked`` per call
    pool_s: dict[str, float] = field(default_factory=dict)   # a CXL pool's "link cxl->cpu", "queue ..." seconds

    @property
    def moved_bytes(self) -> int:
        """Bytes moved between tiers (blocks put by the caller excluded)."""
        return sum(n for link, n in self.bytes_by_link.items() if not link.startswith("new->"))

    @property
    def stall_fraction(self) -> float:
        return self.stall_s / self.total_s if self.total_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__ if name != "trace"} | {
            "moved_bytes": self.moved_bytes, "stall_fraction": self.stall_fraction}


def replay(trace: AccessTrace, model: TierModel, config: ReplayConfig = ReplayConfig()) -> ReplayResult:
    """Run the trace through a TierManager over modelled tiers; bytes, hits and stall per the model."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(_replay(trace, model, config))
    except BaseException:       # (Ctrl-C mid-replay): its tasks are cancelled and run to their end, not
        tasks = asyncio.all_tasks(loop)                                      # left pending at the exit
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        raise
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def _replay(trace: AccessTrace, model: TierModel, config: ReplayConfig) -> ReplayResult:
    prefetch = resolve_prefetch(config.prefetch, trace.meta)
    plan = plan_prefetch(trace, prefetch)
    manager = _sim_manager(trace, model, config)
    seen = AccessRecorder(read_tier=trace.meta.read_tier, clock=asyncio.get_running_loop().time).attach(manager)
    await manager.start()
    try:
        driver = Driver(trace, manager, seen, plan, config.scale_per_op(trace))
        blocked, end = await driver.run()
        await manager.flush()
    finally:
        await manager.aclose()
    sim = replace(seen.trace(manager, events=[]), op_blocked=blocked)  # the modelled waits, per op
    gets, decode = trace.op_kind == OpKind.GET, trace.step_kind[trace.op_step] == STEP_KINDS.index("decode")
    return ReplayResult(
        {t.name: config.policies.get(t.name, t.policy) for t in trace.meta.tiers}, prefetch,
        link_bytes(manager.events.events), sim.served(), sim.hit_rates(),
        float(blocked[gets].sum()), float(blocked[gets & decode].sum()), float(blocked[~gets].sum()),
        float((compute_gaps(trace) * config.scale_per_op(trace)).sum()), end, sim, _pool_seconds(manager.events.events))


def _pool_seconds(events: list[Event]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for e in events:
        if e.kind in (EventKind.LINK, EventKind.QUEUE):
            seconds[f"{e.kind} {e.src or 'new'}->{e.dst}"] += e.done - e.start
    return dict(sorted(seconds.items()))


def _sim_manager(trace: AccessTrace, model: TierModel, config: ReplayConfig) -> TierManager:
    meta = trace.meta
    names = [t.name for t in meta.tiers]
    unknown = sorted((set(config.policies) | set(config.slots)) - set(names))
    if unknown:
        raise ConfigError(f"tiers {unknown}: not in the trace; its tiers: {', '.join(names)}")
    scratch = torch.zeros(meta.block_bytes, dtype=torch.uint8)
    specs = [replace(t, slots=config.slots.get(t.name, t.slots), policy=config.policies.get(t.name, t.policy))
             for t in meta.tiers]
    tiers = [SimStore(s, meta.block_bytes) if s.medium == Medium.NVME.value
             else SimArena(s, meta.block_bytes, scratch) for s in specs]
    _seed_store(trace, tiers)
    policies = {s.name: make_policy(s.policy, capacity=s.slots) for s in specs}
    knobs = IOKnobs(copy_threads=meta.copy_threads, inflight_bytes=meta.inflight_bytes)
    events = EventRecorder()
    pools = frozenset(s.name for s in specs if s.medium == Medium.CXL.value)
    for name in pools:
        model = model.with_pool(name, link_spec(config.cxl_preset))
    # The one seam replaced: transfers complete in modelled, virtual time.
    runner = ModelledRunner(model, events, pools)
    executor = Executor(knobs.copy_threads, knobs.inflight_bytes, events, runner)
    return TierManager(tiers, policies=policies, knobs=knobs, recorder=events, executor=executor)


def _seed_store(trace: AccessTrace, tiers: list[Any]) -> None:
    """Blocks read (or guessed) before any put were stored before the recording: the store holds them
    from the start."""
    first = np.unique(trace.block, return_index=True)[1]
    kinds = np.repeat(trace.op_kind, trace.op_count)[first]
    stored_before = np.flatnonzero(kinds != OpKind.PUT)
    if not len(stored_before):
        return
    store = next((t for t in tiers if isinstance(t, SimStore)), None)
    if store is None or store.pool.capacity < len(stored_before):
        raise ConfigError(f"the trace reads {len(stored_before)} blocks it never stored; replaying that needs a "
                          "store tier (nvme) large enough to hold them from the start")
    store.seed([block_key(int(i)) for i in stored_before])


