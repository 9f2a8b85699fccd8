"""Processing near memory: chunk selection executed "at the memory" of a simulated CXL pool.

The processor keeps each layer's chunk landmarks in the pool and scores a
query against them where they lie, so the landmarks never cross the link;
only the query goes in and the chosen chunk ids come back::

    host                         link                    pool (device DRAM + processor)
    store(layer, landmarks)  ──new rows──▶ write    ──▶  mirror[layer] grows (append-only)
    select(layer, q, k)      ──q [Hq, D]─▶ write    ──▶  scores = landmark_scores(q, mirror)
                                                         ids = top_chunks(scores, k, candidates)
                             ◀─ids [Hkv, k'] int32─ read ◀┘

The math is `tierkv.scoring`'s, run on the pool's own copy of the data, so the
ids are exactly those host-side selection picks. The time is modelled, and
the calling thread sleeps until the modelled completion, as on the link (the
ids are computed on this host meanwhile; where that takes longer than the
model, the excess is the simulation's own cost, kept in ``stats.overrun_s``):

    compute = launch + max(scanned bytes / scan bandwidth, FLOPs / throughput)
              + compares / select rate
    scanned = C * Hkv * D * itemsize (landmarks) + C / 8 (candidate bits)
    FLOPs   = 2 * Hq * D * C         compares = Hkv * (2 C + k log2 k)   (quickselect, sort the ids)

Commands queue on the processor (one at a time; every device of the pool
works on each command, on its share of the chunks). Mirroring charges the
link for every byte written: the rows added since the last call, a rewritten
last row (a chunk still filling), and the candidate bits when they change.
A layer whose chunk count shrank, or whose rows changed shape, is mirrored
again from scratch (a new sequence).

Presets (``PNM_PRESETS``); sourced figures are cited, the rest are assumptions:

==============  ========  ========  ==========  ======  ====================================================
preset          scan      compute   top-k rate  launch  basis
==============  ========  ========  ==========  ======  ====================================================
pnm-ocp25       200 GB/s  1.0 TF/s  8 G cmp/s   10 us   CXL-PNM card shown by Samsung, Marvell and Liqid at
                                                        OCP Global Summit 2025: 200 GB/s memory bandwidth,
                                                        4 TB, 16 Arm Neoverse V2 cores with vector/matrix
                                                        engines (source). 1.0 TF/s (of ~1.5 TF/s fp32 peak
                                                        for 16 V2 cores at ~3 GHz), 8 G compares/s and the
                                                        10 us command round trip are assumptions.
pnm-expander    64 GB/s   0.2 TF/s  2 G cmp/s   10 us   a small processor inside an x8 Type-3 expander's
                                                        controller reading its two DDR5-4800 channels
                                                        (76.8 GB/s peak): all assumptions.
==============  ========  ========  ==========  ======  ====================================================

The near-memory LLM work this models: CXL-PNM (Park et al., HPCA'24: an
LPDDR-based CXL processing-near-memory platform running transformer
inference) and its use for 1M-token KV caches (Kim et al., PACT'25,
arXiv:2511.00321: token-page selection offloaded to the PNM).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from tierkv.errors import ConfigError
from tierkv.events import Event, EventKind, EventRecorder
from tierkv.scoring import landmark_scores, top_chunks
from tierkv.tiers.cxl_link import HOST, CxlLink, Direction, LinkSpec, link_spec, sleep_until

INDEX_BYTES = 4  # chunk ids travel back as int32


@dataclass(frozen=True, slots=True)
class PnmSpec:
    """How fast the near-memory processor is."""

    scan_gbps: float      # device DRAM as the processor streams it, 1e9 bytes/s
    tflops: float         # multiply-add throughput, 1e12 FLOP/s
    select_gcmps: float   # top-k comparisons, 1e9 per second
    launch_us: float      # a command's fixed cost: doorbell, decode, completion

    def __post_init__(self) -> None:
        for name in ("scan_gbps", "tflops", "select_gcmps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"pnm {name}={value!r}: must be > 0")
        if isinstance(self.launch_us, bool) or not isinstance(self.launch_us, int | float) or self.launch_us < 0:
            raise ConfigError(f"pnm launch_us={self.launch_us!r}: must be >= 0 (microseconds)")

    def seconds(self, scanned: float, flops: float, compares: float) -> float:
        return (self.launch_us * 1e-6 + max(scanned / (self.scan_gbps * 1e9), flops / (self.tflops * 1e12))
                + compares / (self.select_gcmps * 1e9))


PNM_PRESETS: Mapping[str, PnmSpec] = {
    "pnm-ocp25": PnmSpec(200.0, 1.0, 8.0, 10.0),
    "pnm-expander": PnmSpec(64.0, 0.2, 2.0, 10.0),
}


def pnm_spec(preset: str) -> PnmSpec:
    if preset not in PNM_PRESETS:
        raise ConfigError(f"pnm={preset!r}: unknown; valid presets: {', '.join(PNM_PRESETS)}")
    return PNM_PRESETS[preset]


@dataclass(frozen=True, slots=True)
class Work:
    """One selection's work for the processor (the inputs of `PnmSpec.seconds`)."""

    scanned: int
    flops: int
    compares: float

    @classmethod
    def of(cls, chunks: int, kv_heads: int, head_dim: int, q_heads: int, itemsize: int, k: int) -> Work:
        k = min(k, chunks)
        compares = kv_heads * (2 * chunks + k * math.log2(max(k, 2)))   # quickselect, then sort the k ids
        return cls(chunks * kv_heads * head_dim * itemsize + -(-chunks // 8), 2 * q_heads * head_dim * chunks,
                   compares)


@dataclass(slots=True)
class PnmStats:
    commands: int = 0
    compute_s: float = 0.0      # modelled processor time
    queue_s: float = 0.0        # commands waiting for the processor
    scanned_bytes: int = 0
    mirrored_bytes: int = 0     # landmark rows and candidate bits written into the pool
    overrun_s: float = 0.0      # this host computing the selection slower than the modelled processor


class _Mirror:
    """One layer's landmarks and candidate bits in pool memory; grows by doubling."""

    def __init__(self, like: Tensor) -> None:
        self.rows = torch.empty((max(64, like.shape[0]), *like.shape[1:]), dtype=like.dtype)
        self.candidates = torch.zeros(self.rows.shape[0], dtype=torch.bool)
        self.count = 0

    def fits(self, landmarks: Tensor) -> bool:
        return (landmarks.shape[1:] == self.rows.shape[1:] and landmarks.dtype == self.rows.dtype
                and landmarks.shape[0] >= self.count)

    def update(self, landmarks: Tensor, candidates: Tensor) -> int:
        """Copy what changed; returns the bytes that crossed the link for it."""
        chunks, row_bytes = landmarks.shape[0], landmarks[0].nbytes if len(landmarks) else 0
        first = self.count
        if first and not torch.equal(self.rows[first - 1], landmarks[first - 1]):
            first -= 1  # the last chunk was still filling: send it again
        self._reserve(chunks)
        self.rows[first:chunks] = landmarks[first:chunks]
        sent = (chunks - first) * row_bytes
        new_bits = candidates[:chunks].cpu()
        if not torch.equal(self.candidates[:self.count], new_bits[:self.count]):
            sent += -(-chunks // 8)      # the whole bitmap again
        elif chunks > self.count:
            sent += -(-(chunks - self.count) // 8)
        self.candidates[:chunks] = new_bits
        self.count = chunks
        return sent

    def _reserve(self, chunks: int) -> None:
        if chunks <= self.rows.shape[0]:
            return
        grown = max(chunks, 2 * self.rows.shape[0])
        rows = torch.empty((grown, *self.rows.shape[1:]), dtype=self.rows.dtype)
        rows[:self.count] = self.rows[:self.count]
        cand = torch.zeros(grown, dtype=torch.bool)
        cand[:self.count] = self.candidates[:self.count]
        self.rows, self.candidates = rows, cand


class NearMemoryProcessor:
    """Scores queries against landmarks kept in a simulated pool; only ids cross back.

    ``link``: the pool's `CxlLink` (share a cxl tier's ``tier.link`` so selections and block
    moves contend), a `LinkSpec`, or a preset name. ``recorder`` receives ``queue``, ``link``
    and ``compute`` slices.
    """

    def __init__(self, link: CxlLink | LinkSpec | str = "cxl2-x8", spec: PnmSpec | str = "pnm-ocp25", *,
                 name: str = "cxl", recorder: EventRecorder | None = None) -> None:
        if isinstance(link, str):
            link = link_spec(link)
        self.link = link if isinstance(link, CxlLink) else CxlLink(link, recorder)
        self.spec = pnm_spec(spec) if isinstance(spec, str) else spec
        self.name = name
        self.recorder = recorder if recorder is not None else self.link.recorder
        self.stats = PnmStats()
        self._mirrors: dict[int, _Mirror] = {}
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def attach(self, recorder: EventRecorder) -> None:
        """Record slices into ``recorder`` (a run's events), also the link's if it records nowhere."""
        self.recorder = recorder
        if self.link.recorder is None:
            self.link.recorder = recorder

    # -- the two commands ------------------------------------------------------------
    def store(self, layer: int, landmarks: Tensor, candidates: Tensor) -> int:
        """Mirror ``layer``'s landmarks [C, Hkv, D] and candidates [C] into the pool; returns bytes sent."""
        mirror = self._mirrors.get(layer)
        if mirror is None or not mirror.fits(landmarks):
            mirror = self._mirrors[layer] = _Mirror(landmarks)
        sent = mirror.update(landmarks.detach().cpu(), candidates)
        if sent:
            self.link.transfer(Direction.WRITE, sent, src=HOST, dst=self.name, layer=layer)
            self.stats.mirrored_bytes += sent
        return sent

    def select(self, layer: int, query: Tensor, k: int) -> Tensor:
        """Chunk ids [Hkv, k'] (ascending) for ``query`` [Hq, D] over the stored landmarks of ``layer``."""
        mirror = self._mirrors.get(layer)
        if mirror is None:
            raise KeyError(f"layer={layer}: no landmarks stored in the pool; call store() first")
        self.link.transfer(Direction.WRITE, query.nbytes, src=HOST, dst=self.name, layer=layer)
        rows, candidates = mirror.rows[:mirror.count], mirror.candidates[:mirror.count]
        work = Work.of(mirror.count, rows.shape[1], rows.shape[2], query.shape[0], rows.element_size(), k)
        ids = self._compute(work, layer, lambda: top_chunks(landmark_scores(query.cpu(), rows), k, candidates))
        self.link.transfer(Direction.READ, ids.numel() * INDEX_BYTES, src=self.name, dst=HOST, layer=layer)
        return ids.to(query.device)

    def forget(self, layer: int | None = None) -> None:
        """Drop the mirrored landmarks of ``layer`` (None: every layer)."""
        if layer is None:
            self._mirrors.clear()
        else:
            self._mirrors.pop(layer, None)

    def reset_stats(self) -> None:
        self.stats = PnmStats()
        self.link.reset_stats()

    # -- internals ---------------------------------------------------------------------
    def _compute(self, work: Work, layer: int, run) -> Tensor:
        devices = self.link.spec.devices   # each device scores its share of the chunks
        seconds = self.spec.seconds(work.scanned / devices, work.flops / devices, work.compares / devices)
        submit, begin, done = self.reserve(seconds)
        result = run()   # on this host, for the ids; its own time is the simulation's cost
        self.stats.overrun_s += max(0.0, time.perf_counter() - done)
        sleep_until(done)
        self._account(work, submit, begin, done, layer)
        return result

    def reserve(self, seconds: float) -> tuple[float, float, float]:
        """Queue a command of ``seconds`` on the processor: (submitted, begins, done), perf_counter times."""
        submit = time.perf_counter()
        with self._lock:
            begin = max(submit, self._busy_until)
            self._busy_until = done = begin + seconds
        return submit, begin, done

    def _account(self, work: Work, submit: float, begin: float, done: float, layer: int) -> None:
        """Stats, and the modelled slices: ``queue`` (waiting for the processor) and ``compute``."""
        self.stats.commands += 1
        self.stats.compute_s += done - begin
        self.stats.queue_s += begin - submit
        self.stats.scanned_bytes += work.scanned
        if self.recorder is None:
            return
        if begin > submit:
            self.recorder.record(Event(EventKind.QUEUE, self.name, self.name, layer, work.scanned, submit, submit, begin))
        self.recorder.record(Event(EventKind.COMPUTE, self.name, self.name, layer, work.scanned, submit, begin, done))
