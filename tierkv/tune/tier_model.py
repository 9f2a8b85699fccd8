"""The tier model: how long moving blocks over each link between tiers takes, for the replay.

A transfer of n blocks, b bytes on link src->dst::

    seconds = b / bandwidth + latency * ceil(n / queue_depth)

It starts when its channel is free (links naming the same channel, e.g. a
store's reads and writes, share one clock) and completes ``overhead_us``
later (handing it to a worker thread and back); `tierkv.tune.simulation`
keeps the channels' clocks.

A simulated CXL pool (a tier of medium ``cxl``) is priced by its link model
(`TierModel.with_pool`, from a preset unless the model names the pool's links
itself): reads out of the pool on one channel, writes into it on another, a
transfer's latency once (the link pipelines requests), devices striped.

A tier model comes from a dict (by hand), from ``tierkv.profile.probe``
(`TierModel.from_probe`: the device, measured idle), or from the recorded
run itself (`TierModel.from_trace`: each link's bytes over its busy time, so
the run's contention for CPU and device is in it).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tierkv.errors import ConfigError
from tierkv.profile.access_trace import AccessTrace
from tierkv.tiers.cxl_link import LinkSpec


MIN_GBPS, MAX_GBPS = 1e-3, 1e4   # a link from 1 MB/s to 10 TB/s: past either, no device (and a replay's clock
MAX_US = 1e7                     # would run for ages); latencies and overheads up to 10 s


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class Link:
    """How long moving blocks over one link takes."""

    gbps: float              # streaming bandwidth, 1e9 bytes/s
    latency_us: float = 0.0  # per round of requests
    queue_depth: int = 1     # requests served at once (one request per block)
    channel: str = ""        # links naming the same channel queue on one clock; "": the link's own

    def __post_init__(self) -> None:
        if not (_number(self.gbps) and MIN_GBPS <= self.gbps <= MAX_GBPS):
            raise ConfigError(f"gbps={self.gbps!r}: a link's bandwidth is {MIN_GBPS:g} to {MAX_GBPS:g} GB/s")
        if not (_number(self.latency_us) and 0 <= self.latency_us <= MAX_US):
            raise ConfigError(f"latency_us={self.latency_us!r}: 0 to {MAX_US:g} us")
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
        if not (_number(self.overhead_us) and 0 <= self.overhead_us <= MAX_US):
            raise ConfigError(f"overhead_us={self.overhead_us!r}: 0 to {MAX_US:g} us")

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
            shown = repr(raw)
            shown = shown if len(shown) <= 200 else shown[:200] + "..."
            raise ConfigError(f"tier model {shown}: expected {{'links': {{'src->dst': {{'gbps': ..., "
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
        """Links priced by a run's `link_stats.link_stats` / `link_stats.device_stats`.

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
