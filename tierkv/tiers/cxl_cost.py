"""What one sparse decode step costs with its KV in a CXL pool, in local memory or on NVMe (a model).

Per layer, a ShadowKV step scores the query against every chunk landmark,
keeps the top ``k`` chunks per KV head and fetches their values. Where the
landmarks and values live decides what crosses which link::

    config               landmarks     scored by        values     crosses the CXL link per layer
    pool-host     (a)    pool          host             pool       landmarks + values
    pool-near     (b)    pool          pool processor   pool       query + ids + values
    local         (c)    local DRAM    host             local      nothing
    nvme          (d)    local DRAM    host             NVMe       nothing (values cross the disk link)
    pool-values          local DRAM    host             pool       values

Sizes per layer (C = context / chunk_tokens chunks, k = ceil(budget * C)),
itemsize b, chunk of T tokens::

    landmarks  C * Hkv * D * b        values  Hkv * k * T * D * b      query  Hq * D * b
    ids        Hkv * k * 4            scoring FLOPs 2 * Hq * D * C     top-k compares Hkv * (2 C + k log2 k)

Time per layer, serial (score, then fetch; the model does not overlap layers)::

    scan(bytes, bw)  = max(bytes / bw, FLOPs / host TFLOP/s) + compares / host rate
    (a)  scan(landmarks, link read) + latency + values / link read + latency
    (b)  query / link write + latency + processor(landmarks) + ids / link read + latency
         + values / link read + latency
    (c)  scan(landmarks, DRAM) + values / DRAM
    (d)  scan(landmarks, DRAM) + 4 KiB pages of values / disk + disk latency
    pool-values  scan(landmarks, DRAM) + values / link read + latency

A pool's devices stripe every transfer (bandwidth x devices). The host
figures (`Host`) are assumptions for a CXL-capable server unless a caller
passes measured ones: ``SERVER`` takes 8 channels of DDR5-4800 (307 GB/s
peak, the Sapphire Rapids memory system) at ~80 % = 250 GB/s, and a PCIe
4.0 x4 SSD at 7 GB/s with 80 us latency.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from tierkv.errors import ConfigError
from tierkv.tiers.cxl_link import LinkSpec
from tierkv.tiers.cxl_pnm import INDEX_BYTES, PnmSpec, Work

PAGE = 4096
CONFIGS = ("pool-host", "pool-near", "local", "nvme", "pool-values")


@dataclass(frozen=True, slots=True)
class Geometry:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 2
    chunk_tokens: int = 8


GEOMETRIES = {
    "smollm2-135m": Geometry(30, 9, 3, 64),     # the project's default model
    "llama3-8b": Geometry(32, 32, 8, 128),      # the size the published CXL/PNM results use
}


@dataclass(frozen=True, slots=True)
class Host:
    memory_gbps: float     # local DRAM read bandwidth, 1e9 bytes/s
    tflops: float          # scoring throughput
    select_gcmps: float    # top-k compares, 1e9/s
    nvme_gbps: float
    nvme_latency_us: float


SERVER = Host(memory_gbps=250.0, tflops=2.0, select_gcmps=20.0, nvme_gbps=7.0, nvme_latency_us=80.0)


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer's sizes at a context and budget."""

    landmarks: int
    values: int
    query: int
    ids: int
    work: Work

    @classmethod
    def of(cls, g: Geometry, context: int, budget: float) -> Layer:
        if not 0 < budget <= 1:
            raise ConfigError(f"budget={budget!r}: a fraction of the context in (0, 1]")
        chunks = -(-context // g.chunk_tokens)
        k = max(1, math.ceil(budget * chunks))
        chunk_bytes = g.chunk_tokens * g.head_dim * g.itemsize
        return cls(chunks * g.kv_heads * g.head_dim * g.itemsize, g.kv_heads * k * chunk_bytes,
                   g.q_heads * g.head_dim * g.itemsize, g.kv_heads * k * INDEX_BYTES,
                   Work.of(chunks, g.kv_heads, g.head_dim, g.q_heads, g.itemsize, k))

    def pages(self, g: Geometry) -> int:
        """Bytes an NVMe read of the values moves: each chunk's values of one head, in 4 KiB pages."""
        chunk_bytes = g.chunk_tokens * g.head_dim * g.itemsize
        return self.values // chunk_bytes * (-(-chunk_bytes // PAGE) * PAGE)


@dataclass(frozen=True, slots=True)
class StepCost:
    config: str
    link_bytes: int      # per step: bytes across the CXL link (nvme: across the disk link)
    seconds: float       # modelled step time (selection and value fetch, every layer)


def step_costs(g: Geometry, context: int, budget: float, link: LinkSpec, pnm: PnmSpec,
               host: Host = SERVER) -> dict[str, StepCost]:
    layer = Layer.of(g, context, budget)
    costs = {name: fn(layer, g, link, pnm, host) for name, fn in _PER_LAYER.items()}
    return {name: StepCost(name, n * g.layers, s * g.layers) for name, (n, s) in costs.items()}


def _scan(layer: Layer, gbps: float, host: Host) -> float:
    w = layer.work
    return max(layer.landmarks / (gbps * 1e9), w.flops / (host.tflops * 1e12)) + w.compares / (host.select_gcmps * 1e9)


def _over(link: LinkSpec, nbytes: int, write: bool = False) -> float:
    gbps = (link.write_gbps if write else link.read_gbps) * link.devices
    return nbytes / (gbps * 1e9) + link.latency_ns * 1e-9


def _pool_host(l: Layer, g: Geometry, link: LinkSpec, pnm: PnmSpec, host: Host) -> tuple[int, float]:
    to_host = _scan(l, link.read_gbps * link.devices, host) + link.latency_ns * 1e-9
    return l.landmarks + l.values, to_host + _over(link, l.values)


def _pool_near(l: Layer, g: Geometry, link: LinkSpec, pnm: PnmSpec, host: Host) -> tuple[int, float]:
    d, w = link.devices, l.work
    compute = pnm.seconds(w.scanned / d, w.flops / d, w.compares / d)
    seconds = _over(link, l.query, write=True) + compute + _over(link, l.ids) + _over(link, l.values)
    return l.query + l.ids + l.values, seconds


def _local(l: Layer, g: Geometry, link: LinkSpec, pnm: PnmSpec, host: Host) -> tuple[int, float]:
    return 0, _scan(l, host.memory_gbps, host) + l.values / (host.memory_gbps * 1e9)


def _nvme(l: Layer, g: Geometry, link: LinkSpec, pnm: PnmSpec, host: Host) -> tuple[int, float]:
    disk = l.pages(g)
    return disk, _scan(l, host.memory_gbps, host) + disk / (host.nvme_gbps * 1e9) + host.nvme_latency_us * 1e-6


def _pool_values(l: Layer, g: Geometry, link: LinkSpec, pnm: PnmSpec, host: Host) -> tuple[int, float]:
    return l.values, _scan(l, host.memory_gbps, host) + _over(link, l.values)


_PER_LAYER: dict[str, Callable[..., tuple[int, float]]] = {
    "pool-host": _pool_host, "pool-near": _pool_near, "local": _local, "nvme": _nvme, "pool-values": _pool_values}


# -- where near-memory scoring stops paying -------------------------------------------------
def _near_gain(g: Geometry, context: int, budget: float, link: LinkSpec, pnm: PnmSpec, host: Host) -> float:
    costs = step_costs(g, context, budget, link, pnm, host)
    return costs["pool-host"].seconds - costs["pool-near"].seconds


def break_even_budget(g: Geometry, context: int, link: LinkSpec, pnm: PnmSpec, host: Host = SERVER,
                      low: float = 1e-4) -> float | None:
    """The smallest budget at which host scoring (a) is no slower than near-memory scoring (b),
    on a log grid from ``low`` to 100 %; None when near-memory is faster at every budget."""
    grid = [low * (1 / low) ** (i / 400) for i in range(401)]
    return next((b for b in grid if _near_gain(g, context, b, link, pnm, host) <= 0), None)


def break_even_context(g: Geometry, budget: float, link: LinkSpec, pnm: PnmSpec, host: Host = SERVER,
                       low: int = 256, high: int = 1 << 24) -> int | None:
    """The smallest context (a power of two) from which near-memory scoring is faster; None: never."""
    ctx = low
    while ctx <= high:
        if _near_gain(g, ctx, budget, link, pnm, host) > 0:
            return ctx
        ctx *= 2
    return None


def break_even_scan_gbps(g: Geometry, context: int, budget: float, link: LinkSpec, pnm: PnmSpec,
                         host: Host = SERVER) -> float | None:
    """The near-memory scan bandwidth at which (a) and (b) take equally long (bisection, GB/s);
    None when no scan rate makes (b) faster (its compute or command overhead alone loses)."""
    lo, hi = 1e-3, 1e5
    if _near_gain(g, context, budget, link, replace(pnm, scan_gbps=hi), host) <= 0:
        return None
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        faster = _near_gain(g, context, budget, link, replace(pnm, scan_gbps=mid), host) > 0
        lo, hi = (lo, mid) if faster else (mid, hi)
    return hi
