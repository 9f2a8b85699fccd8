"""Trace replay: eviction and prefetch policies run over a recorded access trace, without the model.

The replay drives the real `TierManager` (placement, eviction, demotion,
write-back, joining moves in flight, and the eviction policies under test)
over tiers that keep no bytes, on an event loop whose clock is virtual. Only
the manager's executor runs transfers on another runner: same priority queue,
same limits on transfers and bytes in flight, but a transfer completes when
the tier model says, not when a worker thread finishes::

    trace ──▶ driver ──put / acquire / prefetch──▶ TierManager (the real one)
     (calls, compute between them)                    │ transfers
                                                      ▼
                                 Executor + _ModelledRunner ──▶ TierModel ──▶ completion at virtual t

Time, per call (op) i of the trace::

    compute_i = op_time[i] - (op_time[i-1] + op_blocked[i-1])   the run's own time between calls
    start_i   = end_{i-1} + compute_i * compute_scale[step kind]  virtual clock
    end_i     = when the manager returns (start_i if nothing had to move)
    stall     = sum over gets of end_i - start_i                 (puts are counted apart)

    a transfer of n blocks, b bytes on link src->dst:
        seconds = b / bandwidth + latency * ceil(n / queue_depth)
    it starts when its channel is free (a busy-until clock per channel; links naming
    the same channel, e.g. a store's reads and writes, share one) and completes
    ``overhead_us`` later (handing it to a worker thread and back):

        channel nvme  |==load L3==|=writeback=|====load L4====|
        caller        [compute L2]..stall..[compute L3][compute L4]
                                         ^ acquire of L3 returns

A simulated CXL pool (a tier of medium ``cxl``) is priced by its link model
(`TierModel.with_pool`, from ``ReplayConfig.cxl_preset`` unless the model
names the pool's links itself): reads out of the pool on one channel, writes
into it on another, a transfer's latency once (the link pipelines requests),
devices striped. Transfers through the pool also record its ``queue`` and
``link`` slices, as a real run does; near-memory selections are not in
access traces, so the replay has no ``compute`` slices.

A tier model comes from a dict (by hand), from ``tierkv.profile.probe``
(`TierModel.from_probe`: the device, measured idle), or from the recorded
run itself (`TierModel.from_trace`: each link's bytes over its busy time, so
the run's contention for CPU and device is in it).

Prefetch: a prefetcher (``PREFETCHERS``) turns the trace into requests
"before op ``at``, ``lead`` seconds before it starts (never before the
previous op ended), fetch the blocks of get op ``target``". ``engine`` does
what `tierkv.model.engine.Engine` does: the first group of layer l+1 when
layer l starts, group g+1 just before group g is acquired. The engine's
prefetch callback runs before its acquire, and the moves the prefetch spawns
after the acquire marked its blocks wanted; the replay keeps that order.

A block the trace reads before it ever stores it was stored before the
recording began: it starts in the store, as a reopened NVMe store's blocks do.
"""
from __future__ import annotations

import asyncio
import selectors
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from policies import make_policy
from tierkv.knobs import IOKnobs
from tierkv.errors import ConfigError, TierKVError
from tierkv.keys import BlockKey
from tierkv.manager.executor import Executor, Finish, Job
from tierkv.manager.manager import Lease, TierManager
from tierkv.manager.transfer import Transfer
from tierkv.profile.access import STEP_KINDS, AccessRecorder, AccessTrace, OpKind, TierSpec, link_bytes
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.tiers.base import Medium
from tierkv.tiers.cxl_link import LinkSpec, link_spec
from tierkv.tiers.pool import BlockPool

_THREAD_WAIT_S = 60.0  # nothing scheduled: only a worker thread (asyncio.to_thread) can still wake the loop


class ReplayStalled(TierKVError):
    """The replayed manager waits for something that can never happen."""


# -- the tier model ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Link:
    """How long moving blocks over one link takes."""

    gbps: float              # streaming bandwidth, 1e9 bytes/s
    latency_us: float = 0.0  # per round of requests
    queue_depth: int = 1     # requests served at once (one request per block)
    channel: str = ""        # links naming the same channel queue on one clock; "": the link's own

    def __post_init__(self) -> None:
        if not (isinstance(self.gbps, int | float) and self.gbps > 0):
            raise ConfigError(f"gbps={self.gbps!r}: a link's bandwidth must be > 0 GB/s")
        if not (isinstance(self.latency_us, int | float) and self.latency_us >= 0):
            raise ConfigError(f"latency_us={self.latency_us!r}: must be >= 0")
        if not (isinstance(self.queue_depth, int) and self.queue_depth >= 1):
            raise ConfigError(f"queue_depth={self.queue_depth!r}: must be an integer >= 1")

    def seconds(self, nbytes: int, requests: int) -> float:
        rounds = -(-requests // self.queue_depth)
        return nbytes / (self.gbps * 1e9) + rounds * self.latency_us * 1e-6


@dataclass(frozen=True, slots=True)
class TierModel:
    """Links by ``"src->dst"`` tier names (``new`` is the caller putting a block; ``*`` matches any)."""

    links: Mapping[str, Link]
    overhead_us: float = 0.0  # per transfer, outside the channel: handing it to a worker and back

    def __post_init__(self) -> None:
        bad = [k for k in self.links if k.count("->") != 1 or not all(k.split("->"))]
        if bad:
            raise ConfigError(f"links {bad}: keys must look like 'src->dst' (tier names, 'new' or '*')")
        if self.overhead_us < 0:
            raise ConfigError(f"overhead_us={self.overhead_us!r}: must be >= 0")

    def link(self, src: str, dst: str) -> Link:
        for key in (f"{src}->{dst}", f"{src}->*", f"*->{dst}", "*->*"):
            if key in self.links:
                return self.links[key]
        raise ConfigError(f"no link model for {src}->{dst}; the model has {', '.join(self.links) or 'none'} "
                          f"(add '{src}->{dst}' or a '*' pattern)")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TierModel:
        """``{"links": {"nvme->*": {"gbps": 2.1, "latency_us": 90, "queue_depth": 4, "channel": "nvme"}},
        "overhead_us": 60}``."""
        try:
            links = {k: Link(**v) for k, v in raw["links"].items()}
            return cls(links, float(raw.get("overhead_us", 0.0)))
        except (KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"tier model {dict(raw)!r}: expected {{'links': {{'src->dst': {{'gbps': ..., "
                              f"'latency_us': ..., 'queue_depth': ..., 'channel': ...}}}}, 'overhead_us': ...}} "
                              f"({err})") from None

    @classmethod
    def from_probe(cls, probe: Mapping[str, Any], overhead_us: float = 0.0) -> TierModel:
        """From ``tierkv.profile.probe`` results: its links as measured, plus wildcards for the other tiers.

        ``nvme->cpu`` also prices ``nvme->*`` and ``cpu->nvme`` prices ``*->nvme`` (one
        ``nvme`` channel for both directions); ``cpu->cpu`` prices every other pair.
        """
        raw = probe.get("links", probe)
        links = {name: _probe_link(name, rec) for name, rec in raw.items()}
        for name, wildcard in (("nvme->cpu", "nvme->*"), ("cpu->nvme", "*->nvme"), ("cpu->cpu", "*->*")):
            if name in links:
                links.setdefault(wildcard, links[name])
        return cls(links, overhead_us)

    @classmethod
    def from_trace(cls, trace: AccessTrace) -> TierModel:
        """The links as the recorded run saw them (its ``info["links"]`` and ``info["devices"]``)."""
        info = trace.meta.info
        if "links" not in info:
            raise ConfigError("the trace carries no link statistics (recorded without a manager's events)")
        return cls.from_run(info["links"], info.get("devices", {}))

    @classmethod
    def from_run(cls, links: Mapping[str, Mapping[str, float]],
                 devices: Mapping[str, Mapping[str, float]] | None = None) -> TierModel:
        """Links priced by a run's `access.link_stats` / `access.device_stats`.

        Bandwidth is bytes over the time a link (a device: reads and writes together,
        one channel) was busy, overlaps counted once, so the run's contention for CPU
        and device is in it; latency is folded into it. Memory links the run did not
        use get the pooled memory rate (``*->*``); the overhead is the mean of the
        links' median waits from submit to start.
        """
        devices = devices or {}
        model = {f"{a}->{b}": _run_link(st, d) for d, st in devices.items() if st["union_s"] > 0
                 for a, b in ((d, "*"), ("*", d))}
        memory = {k: st for k, st in links.items() if not set(k.split("->")) & set(devices) and st["union_s"] > 0}
        model |= {name: _run_link(st, "") for name, st in memory.items()}
        if memory:
            model["*->*"] = _run_link({"bytes": sum(st["bytes"] for st in memory.values()),
                                       "union_s": sum(st["union_s"] for st in memory.values())}, "")
        if not model:
            raise ConfigError("the run moved nothing with a measurable duration: no links to price")
        queued = [(st["queued_s"], st["transfers"]) for st in links.values()]
        overhead = sum(q * n for q, n in queued) / max(1, sum(n for _, n in queued))
        return cls(model, round(overhead * 1e6, 1))

    def as_dict(self) -> dict[str, Any]:
        return {"links": {k: asdict(v) for k, v in self.links.items()}, "overhead_us": self.overhead_us}

    def with_pool(self, name: str, spec: LinkSpec) -> TierModel:
        """This model plus the links of CXL pool ``name``, unless it already names that tier's links."""
        if any(name in key.split("->") for key in self.links):
            return self
        devices, latency_us, depth = spec.devices, spec.latency_ns / 1e3, 1 << 20  # latency once per transfer
        pool = {f"{name}->*": Link(spec.read_gbps * devices, latency_us, depth, f"{name}:read"),
                f"*->{name}": Link(spec.write_gbps * devices, latency_us, depth, f"{name}:write")}
        return TierModel({**pool, **self.links}, self.overhead_us)


def _run_link(stats: Mapping[str, float], channel: str) -> Link:
    return Link(stats["bytes"] / stats["union_s"] / 1e9, 0.0, 1, channel)


def _probe_link(name: str, record: Mapping[str, Any]) -> Link:
    try:
        return Link(float(record["gbps"]), float(record["latency_us"]), int(record.get("queue_depth", 1)),
                    "nvme" if "nvme" in name.split("->") else "")
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"probe link {name}={dict(record)!r}: expected gbps, latency_us, queue_depth ({err})") \
            from None


# -- prefetchers ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prefetch:
    at: int       # issued before op ``at`` starts ...
    lead: float   # ... this many seconds before it (never before op at-1 ended)
    target: int   # the get op whose blocks it fetches


def _gets_by_layer(trace: AccessTrace) -> dict[tuple[int, int], list[int]]:
    gets: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in np.flatnonzero(trace.op_kind == OpKind.GET).tolist():
        gets[(int(trace.op_step[i]), int(trace.op_layer[i]))].append(i)
    return gets


def no_prefetch(trace: AccessTrace) -> list[Prefetch]:
    return []


def next_get_prefetch(trace: AccessTrace) -> list[Prefetch]:
    """Each get prefetches the next get of its step."""
    gets = np.flatnonzero(trace.op_kind == OpKind.GET).tolist()
    return [Prefetch(i, 0.0, j) for i, j in zip(gets, gets[1:]) if trace.op_step[i] == trace.op_step[j]]


def engine_prefetch(trace: AccessTrace) -> list[Prefetch]:
    """As the engine: layer l+1's first group when layer l starts; group g+1 before group g is acquired."""
    gets = _gets_by_layer(trace)
    plan = [Prefetch(i, 0.0, j) for ops in gets.values() for i, j in zip(ops, ops[1:])]
    first: dict[tuple[int, int], int] = {}
    for i, (step, layer) in enumerate(zip(trace.op_step.tolist(), trace.op_layer.tolist())):
        first.setdefault((step, layer), i)
    for (step, layer), at in first.items():
        following = gets.get((step, layer + 1)) if layer >= 0 else None
        if following:
            plan.append(Prefetch(at, _layer_lead(trace, step, layer, at), following[0]))
    return plan


def _layer_lead(trace: AccessTrace, step: int, layer: int, at: int) -> float:
    """How long before op ``at`` its layer began (0 when the trace does not know)."""
    if layer >= trace.meta.layers:
        return 0.0
    began = trace.layer_start[step * trace.meta.layers + layer]
    return 0.0 if np.isnan(began) else max(0.0, float(trace.op_time[at] - began))


PREFETCHERS: dict[str, Callable[[AccessTrace], list[Prefetch]]] = {
    "none": no_prefetch, "next": next_get_prefetch, "engine": engine_prefetch}


# -- configuration and result -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReplayConfig:
    policies: Mapping[str, str] = field(default_factory=dict)  # tier -> eviction policy (default: the trace's)
    prefetch: str = "engine"                                   # a name in PREFETCHERS
    slots: Mapping[str, int] = field(default_factory=dict)     # tier -> budget in blocks (default: the trace's)
    compute_scale: float | Mapping[str, float] = 1.0           # the trace's compute times x this, or per step
                                                               # kind: {"prefill": x, "decode": y} (what-if)
    cxl_preset: str = "cxl2-x8"                                # prices a cxl tier the model does not name

    def __post_init__(self) -> None:
        if self.prefetch not in PREFETCHERS:
            raise ConfigError(f"prefetch={self.prefetch!r}: allowed: {', '.join(PREFETCHERS)}")
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


def compute_gaps(trace: AccessTrace) -> np.ndarray:
    """Per op, the run's own time from the end of the previous call (or the first step) to this one."""
    if not trace.n_ops:
        return np.zeros(0)
    origin = trace.step_time[0] if trace.n_steps else trace.op_time[0]
    ends = np.concatenate([[origin], (trace.op_time + trace.op_blocked)[:-1]])
    return np.maximum(trace.op_time - ends, 0.0)


def replay(trace: AccessTrace, model: TierModel, config: ReplayConfig = ReplayConfig()) -> ReplayResult:
    """Run the trace through a TierManager over modelled tiers; bytes, hits and stall per the model."""
    loop = _VirtualLoop()
    try:
        return loop.run_until_complete(_replay(trace, model, config))
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


async def _replay(trace: AccessTrace, model: TierModel, config: ReplayConfig) -> ReplayResult:
    manager = _sim_manager(trace, model, config)
    seen = AccessRecorder(read_tier=trace.meta.read_tier, clock=asyncio.get_running_loop().time).attach(manager)
    await manager.start()
    try:
        driver = _Driver(trace, manager, seen, PREFETCHERS[config.prefetch](trace), config.scale_per_op(trace))
        blocked, end = await driver.run()
        await manager.flush()
    finally:
        await manager.aclose()
    sim = replace(seen.trace(manager, events=[]), op_blocked=blocked)  # the modelled waits, per op
    gets, decode = trace.op_kind == OpKind.GET, trace.step_kind[trace.op_step] == STEP_KINDS.index("decode")
    return ReplayResult(
        {t.name: config.policies.get(t.name, t.policy) for t in trace.meta.tiers}, config.prefetch,
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
    tiers = [_SimStore(s, meta.block_bytes) if s.medium == Medium.NVME.value
             else _SimArena(s, meta.block_bytes, scratch) for s in specs]
    _seed_store(trace, tiers)
    policies = {s.name: make_policy(s.policy, capacity=s.slots) for s in specs}
    knobs = IOKnobs(copy_threads=meta.copy_threads, inflight_bytes=meta.inflight_bytes)
    events = EventRecorder()
    pools = frozenset(s.name for s in specs if s.medium == Medium.CXL.value)
    for name in pools:
        model = model.with_pool(name, link_spec(config.cxl_preset))
    # The one seam replaced: transfers complete in modelled, virtual time.
    runner = _ModelledRunner(model, events, pools)
    executor = Executor(knobs.copy_threads, knobs.inflight_bytes, events, runner)
    return TierManager(tiers, policies=policies, knobs=knobs, recorder=events, executor=executor)


def _seed_store(trace: AccessTrace, tiers: list[Any]) -> None:
    """Blocks read before any put were stored before the recording: the store holds them from the start."""
    first = np.unique(trace.block, return_index=True)[1]
    kinds = np.repeat(trace.op_kind, trace.op_count)[first]
    stored_before = np.flatnonzero(kinds == OpKind.GET)
    if not len(stored_before):
        return
    store = next((t for t in tiers if isinstance(t, _SimStore)), None)
    if store is None or store.pool.capacity < len(stored_before):
        raise ConfigError(f"the trace reads {len(stored_before)} blocks it never stored; replaying that needs a "
                          "store tier (nvme) large enough to hold them from the start")
    store.seed([block_key(int(i)) for i in stored_before])


def block_key(block: int) -> BlockKey:
    """The key a replay gives the trace's dense block id."""
    return BlockKey(int(block).to_bytes(16, "little"))


# -- the driver: the trace's calls at their virtual times ------------------------------------
class _Driver:
    def __init__(self, trace: AccessTrace, manager: TierManager, seen: AccessRecorder,
                 plan: list[Prefetch], scale: np.ndarray) -> None:
        self.trace, self.manager, self.seen, self.scale = trace, manager, seen, scale  # compute x scale, per op
        self.keys = [block_key(i) for i in range(trace.n_blocks)]
        self.start = trace.op_start()
        self.plan: dict[int, list[Prefetch]] = defaultdict(list)
        for p in sorted(plan, key=lambda p: -p.lead):
            self.plan[p.at].append(p)
        self.lease: Lease | None = None
        self.steps = 0

    async def run(self) -> tuple[np.ndarray, float]:
        """Play every op; returns (seconds blocked per op, virtual end of the last op)."""
        loop = asyncio.get_running_loop()
        compute = compute_gaps(self.trace) * self.scale
        blocked = np.zeros(self.trace.n_ops)
        data = torch.zeros(self.trace.meta.block_bytes, dtype=torch.uint8)
        end = 0.0
        for op in self.trace.ops():
            self._enter_step(op.step)
            begin = end + compute[op.index]
            for p in self.plan.get(op.index, ()):
                await _sleep_until(loop, max(end, begin - p.lead * self.scale[op.index]))
                self._release()
                self.manager.prefetch(self._keys(p.target), self.trace.meta.read_tier, layer=self._layer(p.target))
                # One step of the prefetch's task runs before the next call, as in the engine, where
                # its callback precedes the acquire; the moves it spawns run after the acquire pinned.
                await asyncio.sleep(0)
            await _sleep_until(loop, begin)
            self._release()
            begin = loop.time()
            if op.kind is OpKind.PUT:
                await self.manager.put(self.keys[int(op.blocks[0])], data, layer=op.layer,
                                       persist=self.trace.meta.persist)
            else:
                self.lease = await self.manager.acquire(self._keys(op.index), self.trace.meta.read_tier,
                                                        layer=op.layer)
            end = loop.time()
            blocked[op.index] = end - begin
        self._release()
        self._enter_step(self.trace.n_steps - 1)
        return blocked, end

    def _enter_step(self, step: int) -> None:
        while self.steps <= step:
            self.seen.begin_step(STEP_KINDS[int(self.trace.step_kind[self.steps])],
                                 int(self.trace.step_tokens[self.steps]))
            self.steps += 1

    def _keys(self, op: int) -> list[BlockKey]:
        return [self.keys[i] for i in self.trace.block[self.start[op]:self.start[op + 1]].tolist()]

    def _layer(self, op: int) -> int | None:
        layer = int(self.trace.op_layer[op])
        return None if layer < 0 else layer

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Wait in virtual time; no yield at all when ``when`` is now (a yield lets queued moves run first)."""
    if when > loop.time():
        await asyncio.sleep(when - loop.time())


# -- tiers without bytes ------------------------------------------------------------------
class _SimArena:
    """A memory tier with slots and no bytes: every slot views one shared scratch block."""

    def __init__(self, spec: TierSpec, block_bytes: int, scratch: torch.Tensor) -> None:
        self.name, self.medium, self.device = spec.name, Medium(spec.medium), scratch.device
        self.reads_in_place = self.medium is not Medium.CXL   # as the real pool: reads load out of it
        self.block_bytes = block_bytes
        self.pool = BlockPool(spec.slots)
        self._scratch = scratch

    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    def view(self, slot: int) -> torch.Tensor:
        return self._scratch

    def buffers(self, slots: list[int]) -> list[torch.Tensor]:
        return [self._scratch] * len(slots)

    def gather(self, slots: list[int], out: torch.Tensor, rows: list[int] | None = None) -> None:
        pass

    def scatter(self, slots: list[int], src: torch.Tensor) -> None:
        pass

    def copy_slots(self, slots: list[int], dst: _SimArena, dst_slots: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class _SimStore:
    """The NVMe store's interface over an index and no files."""

    medium = Medium.NVME
    backend = "sim"

    def __init__(self, spec: TierSpec, block_bytes: int) -> None:
        self.name, self.block_bytes = spec.name, block_bytes
        self.pool = BlockPool(spec.slots)
        self._index: dict[BlockKey, int] = {}

    @property
    def budget_bytes(self) -> int:
        return self.pool.capacity * self.block_bytes

    def seed(self, keys: list[BlockKey]) -> None:
        self._index = {key: slot for slot, key in enumerate(keys)}
        self.pool.restore(list(self._index.values()))

    def lookup(self, key: BlockKey) -> int | None:
        return self._index.get(key)

    def items(self) -> list[tuple[BlockKey, int]]:
        return list(self._index.items())

    def __len__(self) -> int:
        return len(self._index)

    def write(self, items: list[tuple[BlockKey, int, torch.Tensor]], *, priority: int = 0,
              aligned: bool = False) -> None:
        self._index.update((key, slot) for key, slot, _ in items)

    def read(self, items: list[tuple[BlockKey, int, torch.Tensor]], *, priority: int = 0,
             aligned: bool = False) -> list[BlockKey]:
        return [key for key, slot, _ in items if self._index.get(key) != slot]

    def drop(self, key: BlockKey) -> None:
        self._index.pop(key, None)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- virtual time --------------------------------------------------------------------------
class _VirtualSelector(selectors.SelectSelector):
    """Waiting for a timer advances the clock instead of sleeping; worker threads are really waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            ready = super().select(_THREAD_WAIT_S)
            if not ready:
                raise ReplayStalled("replay stalled: the manager waits with no transfer, timer or thread "
                                    "left that could wake it")
            return ready
        self.now += max(timeout, 0.0)
        return super().select(0)


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


class _ModelledRunner:
    """The executor's runner for a replay: transfers take modelled, virtual time.

    A body runs inline when its transfer starts (the tiers hold no bytes, so it
    only updates indexes); it finishes when the link model says the bytes would
    have arrived.
    """

    def __init__(self, model: TierModel, recorder: EventRecorder, pools: frozenset[str] = frozenset()) -> None:
        self.model = model
        self.recorder = recorder
        self.pools = pools   # CXL pool tiers: their transfers also record queue and link slices
        self._busy_until: dict[str, float] = {}

    @staticmethod
    def clock() -> float:
        return asyncio.get_running_loop().time()

    def start(self) -> None:
        pass

    def run(self, job: Job, finish: Finish) -> None:
        loop = asyncio.get_running_loop()
        job.start = loop.time()
        try:
            result, error = job.body(), None
        except Exception as exc:  # a failed transfer, as a worker thread would report it
            result, error = None, exc
        loop.call_at(self._done_at(job.transfer, job.start), finish, job, result, error)

    def close(self) -> None:
        pass

    def _done_at(self, t: Transfer, now: float) -> float:
        src = t.src or "new"
        link = self.model.link(src, t.dst)
        channel = link.channel or f"{src}->{t.dst}"
        begin = max(now, self._busy_until.get(channel, 0.0))
        self._busy_until[channel] = begin + link.seconds(t.nbytes, len(t.keys))
        if self.pools & {src, t.dst}:
            self._record_pool(t, src, now, begin, self._busy_until[channel])
        return self._busy_until[channel] + self.model.overhead_us * 1e-6

    def _record_pool(self, t: Transfer, src: str, now: float, begin: float, done: float) -> None:
        if begin > now:
            self.recorder.record(Event(EventKind.QUEUE, src, t.dst, t.layer, t.nbytes, now, now, begin, len(t.keys)))
        self.recorder.record(Event(EventKind.LINK, src, t.dst, t.layer, t.nbytes, now, begin, done, len(t.keys)))


__all__ = ["Link", "TierModel", "Prefetch", "PREFETCHERS", "ReplayConfig", "ReplayResult", "ReplayStalled",
           "replay", "compute_gaps", "block_key", "engine_prefetch", "next_get_prefetch", "no_prefetch"]
