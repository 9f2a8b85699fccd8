"""How close does each tier come to this machine's own limits?

For each block size, every tierkv path runs next to the limit it should
reach, measured in the same process on the same bytes::

    limit (measured here)                     tierkv path                           ratio
    memcpy     one copy_ of all the bytes     cpu-gather      CpuTier slots, in a   cpu_gather_vs_memcpy
                                                              scattered order, into
                                                              one contiguous tensor
                                              manager-gather  acquire cpu -> gpu    manager_gather_vs_memcpy
                                                              tier, 64 keys a call  (informational)
    raw-write  O_DIRECT pwrite of 4 MiB       nvme-write      NvmeTier.write,       nvme_write_vs_raw
               chunks, best of 1/4 threads                    64 blocks a call
    raw-read   O_DIRECT preadv, likewise      nvme-read       NvmeTier.read         nvme_read_vs_raw
    raw-pages  O_DIRECT pread of each 12 KiB  manager-pages   read of 526 pages a   page_reads_vs_raw
               page, random order, 4 threads                  call, lent where they
                                                              land (the engine's)
                                              manager-pages-  the same, copied      page_reads_copied_vs_raw
                                              copied          into the caller's     (informational)
                                                              rows
    page-memcpy  one copy_ of the pages'      manager-page-   put_many of 526 new   page_puts_vs_memcpy
                 bytes                        puts            pages a call into a   (informational)
                                                              cpu tier (a sparse
                                                              prefill's sealing)

Every probe runs once per round, rounds repeat, and the best round counts:
the machine is shared and noisy, and interleaving lets noise hit a path and
its limit alike. A ratio is the worst over blocks >= 256 KiB. Round 0 of a
disk write lands on fresh space (raw: a new file, nvme: a new store); later
rounds overwrite, as a store does once it recycles slots.

    python bench/tiers.py --quick --out bench/out/tiers.json
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from report import DirectPages, Help, Report, filesystem, machine, out_file, whole
from tierkv.knobs import IOKnobs
from tierkv.sizes import format_size, parse_size
from tierkv.device import has_cuda, host_buffer
from tierkv.keys import BlockKey
from tierkv.manager import BlockingTierManager, TierManager
from tierkv.tiers.cpu import CpuTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.memory import HostSpace
from tierkv.tiers.nvme import NvmeTier

KiB, MiB = 1024, 1024**2
FULL_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
QUICK_SIZES = (256 * KiB, 1 * MiB)
RATIO_MIN_BLOCK = 256 * KiB          # ratios are the worst over blocks at least this big
RAW_CHUNK = 4 * MiB                  # bytes per raw pwrite/preadv
RAW_THREADS = (1, 4)
PAGE = 12 * KiB                      # a sparse page of SmolLM2 in bf16: 16 tokens x 3 KV heads x 64 dims x K+V
PAGES_PER_READ = 526                 # pages one layer of a 32K sparse step reads
IO_THREADS = 4                       # NvmeTier io_threads, as TIERKV_IO_THREADS defaults
RAMDISKS = ("tmpfs", "ramfs", "devtmpfs")
TARGETS = {"nvme_write_vs_raw": 0.9, "nvme_read_vs_raw": 0.9, "cpu_gather_vs_memcpy": 0.8,
           "manager_gather_vs_memcpy": 0.6, "page_reads_vs_raw": 0.8}


@dataclass(frozen=True, slots=True)
class Plan:
    sizes: tuple[int, ...]
    total: int          # bytes moved per probe run, per block size
    rounds: int
    batch: int          # blocks per NvmeTier / manager call
    page_total: int     # bytes of random pages read per round

    def blocks(self, block: int) -> int:
        return self.total // block


@dataclass(slots=True)
class Probe:
    """One timed path: ``run`` moves ``nbytes``; ``prepare`` (untimed) runs before it.

    Per round it records wall seconds and the process's CPU seconds (every
    thread: workers, kernel time of O_DIRECT calls, checksums).
    """

    config: str
    nbytes: int
    nblocks: int
    run: Callable[[], None]
    prepare: Callable[[], None] | None = None
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)

    def once(self) -> None:
        if self.prepare is not None:
            self.prepare()
        cpu, start = time.process_time(), time.perf_counter()
        self.run()
        self.seconds.append(time.perf_counter() - start)
        self.cpu_seconds.append(time.process_time() - cpu)

    @property
    def gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    @property
    def us_per_block(self) -> float:
        return min(self.seconds) / self.nblocks * 1e6

    @property
    def cpu_s_per_gb(self) -> float:
        return min(self.cpu_seconds) / (self.nbytes / 1e9)

    def paired_median(self, limits: list[Probe]) -> float:
        """Median over rounds of this GB/s / the best limit's GB/s in the same round."""
        ratios = [min(ls) / s for s, *ls in zip(self.seconds, *(p.seconds for p in limits))]
        return statistics.median(ratios)


# -- host memory ---------------------------------------------------------------
def fill_pattern(buf: torch.Tensor, seed: int = 0) -> None:
    """Distinct, non-constant bytes in every 4 KiB page (cheaper than randint over GiBs)."""
    pattern = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    for lo in range(0, buf.numel(), pattern.numel()):
        chunk = buf[lo:lo + pattern.numel()]
        chunk.copy_(pattern[:chunk.numel()])
        chunk[::4096] = (lo // 4096) % 251  # first byte of each page differs per page


def filled_cpu_tier(src: torch.Tensor, block: int) -> CpuTier:
    tier = CpuTier(block, src.numel())
    for piece in src.view(-1, block):
        slot = tier.pool.reserve()
        tier.view(slot).copy_(piece)
        tier.pool.commit(slot)
    return tier


def memory_probes(src: torch.Tensor, dst: torch.Tensor, cpu: CpuTier, block: int) -> list[Probe]:
    n = src.numel() // block
    order = list(range(n))
    random.Random(block).shuffle(order)

    def gather() -> None:
        cpu.gather(order, dst)  # the tier's own gather: runs of adjacent slots, memmove on workers

    return [Probe("memcpy", src.numel(), n, lambda: dst.copy_(src)),
            Probe("cpu-gather", src.numel(), n, gather)]


def manager_probe(cpu: CpuTier, block: int, batch: int, stack: contextlib.ExitStack) -> Probe:
    """Acquire every block from the cpu tier into a gpu tier half its size, ``batch`` keys a call.

    Looping over twice what the gpu tier holds makes LRU evict each block
    before it comes round again, so every round moves every byte.
    """
    n = cpu.pool.used
    tiers = [GpuTier(block, n // 2 * block), CpuTier(block, n * block)]
    manager = stack.enter_context(BlockingTierManager(TierManager(tiers, knobs=IOKnobs())))
    keys = [BlockKey.of("bench-manager", block, i) for i in range(n)]
    with ThreadPoolExecutor(4) as callers:  # untimed set-up: overlap the per-put hops to the loop
        list(callers.map(lambda i: manager.put(keys[i], cpu.view(i), tier="cpu"), range(n)))
    step = min(batch, n // 2)

    def acquire_all() -> None:
        for lo in range(0, n, step):
            manager.acquire(keys[lo:lo + step], tier="gpu").release()

    return Probe("manager-gather", n * block, n, acquire_all)


# -- disk ---------------------------------------------------------------------
class RawFile:
    """Sequential O_DIRECT I/O in ``RAW_CHUNK`` pieces, chunks dealt round-robin to threads."""

    def __init__(self, path: Path, buf: torch.Tensor) -> None:
        self.path = path
        self.view = memoryview(buf.numpy())
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        self.pools = {t: ThreadPoolExecutor(t, thread_name_prefix="raw-io") for t in RAW_THREADS if t > 1}

    def write(self, threads: int) -> None:
        self._spread(threads, lambda i, part: os.pwrite(self.fd, part, i * RAW_CHUNK))

    def read(self, threads: int) -> None:
        self._spread(threads, lambda i, part: os.preadv(self.fd, [part], i * RAW_CHUNK))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()
        os.close(self.fd)
        self.path.unlink(missing_ok=True)

    def _spread(self, threads: int, io: Callable[[int, memoryview], int]) -> None:
        chunks = len(self.view) // RAW_CHUNK

        def worker(first: int) -> None:
            for i in range(first, chunks, threads):
                part = self.view[i * RAW_CHUNK:(i + 1) * RAW_CHUNK]
                if io(i, part) != len(part):
                    raise OSError(f"{self.path}: short O_DIRECT I/O at chunk {i}")

        if threads == 1:
            worker(0)
            return
        for future in [self.pools[threads].submit(worker, t) for t in range(threads)]:
            future.result()


def raw_probes(raw: RawFile, n: int) -> list[Probe]:
    nbytes = len(raw.view)
    writes = [Probe(f"raw-write-{t}t", nbytes, n, lambda t=t: raw.write(t)) for t in RAW_THREADS]
    reads = [Probe(f"raw-read-{t}t", nbytes, n, lambda t=t: raw.read(t)) for t in RAW_THREADS]
    return writes + reads


def nvme_probes(store: NvmeTier, src: CpuTier, landing: CpuTier, n: int, batch: int) -> list[Probe]:
    """Write every ``src`` slot into the store, then read it back into ``landing``, ``batch`` blocks a call."""
    keys = [BlockKey.of("bench-nvme", store.block_bytes, i) for i in range(n)]
    slots: list[int] = []

    def recycle() -> None:  # untimed: forget the last round's blocks, as eviction would
        for key in keys[:len(slots)]:
            store.drop(key)
        store.pool.release_many(slots)
        slots.clear()

    def write() -> None:   # slots reserved and committed a batch at a time, as the manager's write-backs do
        for lo in range(0, n, batch):
            got = store.pool.reserve_many(min(batch, n - lo))
            store.write([(keys[lo + j], slot, src.view(lo + j)) for j, slot in enumerate(got)])
            store.pool.commit_many(got)
            slots.extend(got)

    def read() -> None:
        for lo in range(0, n, batch):
            items = [(keys[i], slots[i], landing.view(i)) for i in range(lo, min(lo + batch, n))]
            failed = store.read(items)
            if failed:
                raise RuntimeError(f"nvme read: {len(failed)} block(s) failed their checksum")

    nbytes = n * store.block_bytes
    return [Probe("nvme-write", nbytes, n, write, prepare=recycle), Probe("nvme-read", nbytes, n, read)]


# -- random pages -----------------------------------------------------------------
def page_probes(workdir: Path, plan: Plan, stack: contextlib.ExitStack) -> list[Probe]:
    """Random ``PAGE`` reads from disk, as a sparse decode step makes them: through the manager,
    ``PAGES_PER_READ`` keys a call, from the NVMe tier into a cpu tier a quarter of their size,
    against raw O_DIRECT reads of the same slots, one ``pread`` per page, in the same order, on as
    many threads as the store has I/O threads. Two ways through the manager:

    - ``manager-pages``: the sparse engine's read (``read(keys, lend=True, pin=False, packed=True)``):
      without CUDA the cpu tier lies in a ``HostSpace``, as ``build_tiers`` lays it out, and each page
      is lent where it landed, as a raw read leaves it in its buffer (with CUDA it is copied);
    - ``manager-pages-copied``: ``read(keys, into=rows)``, every page copied into the caller's rows.

    Every round reads every page in one fixed shuffled order, so under LRU each page left the
    cpu tier a whole round before it comes round again: every read goes to the disk.
    """
    n = plan.page_total // PAGE
    space = None if has_cuda() else HostSpace(PAGE)
    cpu = CpuTier(PAGE, n // 4 * PAGE, space=space)
    store = NvmeTier(workdir / "pages", PAGE, n * PAGE, namespace="bench-pages", io_threads=IO_THREADS)
    stack.callback(shutil.rmtree, workdir / "pages", ignore_errors=True)
    manager = stack.enter_context(BlockingTierManager(TierManager([cpu, store], knobs=IOKnobs())))
    keys = [BlockKey.of("bench-pages", PAGE, i) for i in range(n)]
    src = host_buffer(n * PAGE, pinned=False)
    fill_pattern(src, seed=PAGE)
    pages = src.view(n, PAGE)
    with ThreadPoolExecutor(4) as callers:  # untimed set-up: overlap the per-put hops to the loop
        list(callers.map(lambda i: manager.put(keys[i], pages[i], tier="nvme"), range(n)))
    order = list(range(n))
    random.Random(PAGE).shuffle(order)
    rows = host_buffer(PAGES_PER_READ * PAGE, pinned=False).view(PAGES_PER_READ, PAGE)
    check = order[:PAGES_PER_READ]

    hints: dict[int, np.ndarray] = {}    # each call's directory rows, kept as the engine keeps a step's

    def read_lent(part: list[BlockKey], call: int, *, take: bool = False) -> torch.Tensor | None:
        """The engine's read of ``part``; with ``take``, the pages' bytes in ``part``'s order."""
        into = rows[:len(part)]
        future = manager.read(part, into=into, tier="cpu", lend=True, pin=False, packed=True, rows=hints.get(call))
        if future.rows is not None:
            hints[call] = future.rows
        try:
            future.wait()
            if not take:
                return None
            if future.extent is not None:           # lent: each page's row where it lies
                return future.extent[0][torch.from_numpy(future.extent[1])]
            return into if future.placed is None else into[torch.from_numpy(future.placed)]
        finally:
            if future.lease is not None:
                future.lease.release()
            future.release()

    def through_manager() -> None:
        for lo in range(0, n, PAGES_PER_READ):
            read_lent([keys[i] for i in order[lo:lo + PAGES_PER_READ]], lo)

    def copied() -> None:
        for lo in range(0, n, PAGES_PER_READ):
            part = [keys[i] for i in order[lo:lo + PAGES_PER_READ]]
            manager.read(part, into=rows[:len(part)], tier="cpu").wait()

    def verify() -> None:
        got = read_lent([keys[i] for i in check[::-1]], -1, take=True)     # (loaded: a round has passed)
        manager.read([keys[i] for i in check], into=rows, tier="cpu").wait()
        if not (torch.equal(got, pages[check[::-1]]) and torch.equal(rows, pages[check])):
            raise RuntimeError("page reads through the manager returned different bytes")

    raw = DirectPages(store.directory / "slots.dat", PAGE, [store.lookup(keys[i]) * PAGE for i in order],
                      IO_THREADS)   # the store's own slot file, opened a second time
    stack.callback(raw.close)
    return [Probe("raw-pages", n * PAGE, n, raw.read), Probe("manager-pages", n * PAGE, n, through_manager),
            Probe("manager-pages-copied", n * PAGE, n, copied),
            Probe("page-verify", PAGES_PER_READ * PAGE, PAGES_PER_READ, verify)]


def page_put_probes(plan: Plan, stack: contextlib.ExitStack) -> list[Probe]:
    """New ``PAGE`` pages into a memory tier as a sparse prefill seals a layer's: ``put_many`` of
    ``PAGES_PER_READ`` a call into a cpu tier that holds them all, against one ``copy_`` of the same
    bytes. Each round's pages are let go of before the next (untimed); the last are read back."""
    n = plan.page_total // PAGE
    manager = stack.enter_context(BlockingTierManager(TierManager([CpuTier(PAGE, n * PAGE)], knobs=IOKnobs())))
    src = host_buffer(n * PAGE, pinned=False)
    fill_pattern(src, seed=2 * PAGE)
    pages, dst = src.view(n, PAGE), torch.empty_like(src)
    keys = [BlockKey.of("bench-page-puts", PAGE, i) for i in range(n)]

    def put_all() -> None:
        for lo in range(0, n, PAGES_PER_READ):
            manager.put_many(keys[lo:lo + PAGES_PER_READ], pages[lo:lo + PAGES_PER_READ])

    def verify() -> None:
        check = list(range(0, n, 7))
        rows = host_buffer(len(check) * PAGE, pinned=False).view(len(check), PAGE)
        manager.read([keys[i] for i in check], into=rows, tier="cpu").wait()
        if not torch.equal(rows, pages[check]):
            raise RuntimeError("pages put through the manager read back different bytes")

    return [Probe("page-memcpy", n * PAGE, n, lambda: dst.copy_(src)),
            Probe("manager-page-puts", n * PAGE, n, put_all, prepare=lambda: manager.drop(keys)),
            Probe("page-put-verify", n * PAGE, n, verify)]


def measure_pages(plan: Plan, workdir: Path) -> list[Probe]:
    with contextlib.ExitStack() as stack:
        raw, through, copied, verify = page_probes(workdir, plan, stack)
        memcpy, puts, puts_verify = page_put_probes(plan, stack)
        for _ in range(plan.rounds):
            for probe in (raw, through, copied, memcpy, puts):
                probe.once()
        verify.once()
        puts_verify.once()
        return [raw, through, copied, memcpy, puts]


# -- one block size -------------------------------------------------------------
def measure_size(block: int, plan: Plan, workdir: Path) -> tuple[list[Probe], str]:
    """Every probe for one block size, interleaved round by round; returns them and the store backend."""
    n = plan.blocks(block)
    with contextlib.ExitStack() as stack:
        src, dst = host_buffer(n * block, pinned=False), host_buffer(n * block, pinned=False)
        fill_pattern(src, seed=block)
        dst.zero_()  # fault the pages in before anything is timed
        cpu, landing = filled_cpu_tier(src, block), CpuTier(block, n * block)
        for slot in range(n):
            landing.view(slot).zero_()
        stack.callback(shutil.rmtree, workdir / f"nvme-{block}", ignore_errors=True)
        store = stack.enter_context(NvmeTier(workdir / f"nvme-{block}", block, n * block,
                                             namespace="bench", io_threads=IO_THREADS))
        raw = RawFile(workdir / f"raw-{block}.dat", dst)
        stack.callback(raw.close)
        memory = [*memory_probes(src, dst, cpu, block), manager_probe(cpu, block, plan.batch, stack)]
        for probe in memory:
            probe.run()  # warm-up: page faults and first calls stay out of the timings
        raw_write_1, raw_write_4, raw_read_1, raw_read_4 = raw_probes(raw, n)
        nvme_write, nvme_read = nvme_probes(store, cpu, landing, n, plan.batch)
        probes = [*memory, raw_write_1, raw_write_4, nvme_write, raw_read_1, raw_read_4, nvme_read]
        for _ in range(plan.rounds):
            for probe in probes:
                probe.once()
        _verify(cpu, landing, n)
        return probes, store.backend


def _verify(cpu: CpuTier, landing: CpuTier, n: int) -> None:
    bad = [slot for slot in range(n) if not torch.equal(cpu.view(slot), landing.view(slot))]
    if bad:
        raise RuntimeError(f"nvme read back different bytes in {len(bad)} of {n} blocks (first: slot {bad[0]})")


# -- the report -----------------------------------------------------------------
LIMITS = {  # path -> the probes whose best is its limit
    "cpu-gather": ("memcpy",), "manager-gather": ("memcpy",),
    "nvme-write": tuple(f"raw-write-{t}t" for t in RAW_THREADS),
    "nvme-read": tuple(f"raw-read-{t}t" for t in RAW_THREADS),
}


def add_rows(report: Report, block: int, probes: list[Probe], backend: str) -> None:
    by_name = {p.config: p for p in probes}
    for probe in probes:
        limits = [by_name[name] for name in LIMITS.get(probe.config, ())]
        limit = max(limits, key=lambda p: p.gbps, default=None)
        against = {} if limit is None else {
            "limit_gbps": round(limit.gbps, 3), "limit_config": limit.config,
            "vs_limit": round(probe.gbps / limit.gbps, 3),
            "vs_limit_paired_median": round(probe.paired_median(limits), 3),
            "extra_us_per_block": round(probe.us_per_block - limit.us_per_block, 2),
            "extra_cpu_s_per_gb": round(probe.cpu_s_per_gb - limit.cpu_s_per_gb, 3),
        }
        report.add_row(
            probe.config, "throughput", round(probe.gbps, 3), "GB/s", block_bytes=block, **against,
            us_per_block=round(probe.us_per_block, 2), cpu_s_per_gb=round(probe.cpu_s_per_gb, 3),
            nbytes=probe.nbytes, rounds_gbps=[round(probe.nbytes / s / 1e9, 3) for s in probe.seconds],
            **({"backend": backend} if probe.config.startswith("nvme") else {}))


RATIOS = {  # name -> (path, what it divides)
    "nvme_write_vs_raw": ("nvme-write", "NvmeTier.write GB/s ({batch} blocks a call, {io} io threads) / best raw "
                          "O_DIRECT sequential write of the same bytes (4 MiB pwrites, 1 or 4 threads)"),
    "nvme_read_vs_raw": ("nvme-read", "NvmeTier.read GB/s ({batch} blocks a call, {io} io threads, checksums "
                         "verified) / best raw O_DIRECT sequential read of the same bytes (4 MiB preadv, 1 or 4 threads)"),
    "cpu_gather_vs_memcpy": ("cpu-gather", "CpuTier.gather of every slot (scattered order) into "
                             "one contiguous tensor / one copy_ of the same bytes"),
    "manager_gather_vs_memcpy": ("manager-gather", "BlockingTierManager.acquire of every block from the cpu tier "
                                 "into the gpu tier ({batch} keys a call; host memory without CUDA) / one host copy_"),
}


def add_page_rows(report: Report, probes: list[Probe]) -> None:
    raw, through, copied, memcpy, puts = probes
    add_page_put_rows(report, memcpy, puts)
    probes = [raw, through, copied]
    for probe in probes:
        against = {} if probe is raw else {
            "limit_gbps": round(raw.gbps, 3), "limit_config": raw.config, "vs_limit": round(probe.gbps / raw.gbps, 3),
            "vs_limit_paired_median": round(probe.paired_median([raw]), 3),
            "extra_us_per_block": round(probe.us_per_block - raw.us_per_block, 2),
            "extra_cpu_s_per_gb": round(probe.cpu_s_per_gb - raw.cpu_s_per_gb, 3)}
        report.add_row(probe.config, "throughput", round(probe.gbps, 3), "GB/s", block_bytes=PAGE, **against,
                       us_per_block=round(probe.us_per_block, 2), cpu_s_per_gb=round(probe.cpu_s_per_gb, 3),
                       cpu_us_per_block=round(min(probe.cpu_seconds) / probe.nblocks * 1e6, 2),
                       nbytes=probe.nbytes, rounds_gbps=[round(probe.nbytes / s / 1e9, 3) for s in probe.seconds])
    how = (f"random {format_size(PAGE)} pages through BlockingTierManager.read (nvme -> cpu tier, {PAGES_PER_READ} "
           f"keys a call, checksums verified) / raw O_DIRECT preads of the same slots in the same order on "
           f"{IO_THREADS} threads")
    report.add_ratio("page_reads_vs_raw", round(through.gbps / raw.gbps, 3), TARGETS["page_reads_vs_raw"],
                     f"{how}; the sparse engine's read: lent where they land"
                     f"{'' if has_cuda() else ' (the cpu tier in a HostSpace)'}")
    report.add_ratio("page_reads_copied_vs_raw", round(copied.gbps / raw.gbps, 3), None,
                     f"{how}; each page copied into the caller's rows (read(keys, into=rows))")
    cpu_us = {p.config: min(p.cpu_seconds) / p.nblocks * 1e6 for p in probes}
    report.add_bound(f"pages: {raw.nblocks} random {format_size(PAGE)} pages a round; raw {raw.us_per_block:.1f} us "
                     f"per page ({raw.gbps * 1e9 / PAGE:,.0f} pages/s) and {cpu_us[raw.config]:.1f} us of CPU per "
                     f"page (all threads); through the manager, lent {through.us_per_block:.1f} us and "
                     f"{cpu_us[through.config]:.1f} us of CPU, copied {copied.us_per_block:.1f} us and "
                     f"{cpu_us[copied.config]:.1f} us of CPU")


def add_page_put_rows(report: Report, memcpy: Probe, puts: Probe) -> None:
    for probe in (memcpy, puts):
        report.add_row(probe.config, "throughput", round(probe.gbps, 3), "GB/s", block_bytes=PAGE,
                       us_per_block=round(probe.us_per_block, 2), cpu_us_per_block=round(min(probe.cpu_seconds)
                                                                                         / probe.nblocks * 1e6, 2),
                       nbytes=probe.nbytes, rounds_gbps=[round(probe.nbytes / s / 1e9, 3) for s in probe.seconds])
    report.add_ratio("page_puts_vs_memcpy", round(puts.gbps / memcpy.gbps, 3), None,
                     f"new {format_size(PAGE)} pages through BlockingTierManager.put_many ({PAGES_PER_READ} a call, "
                     "into a cpu tier) / one copy_ of the same bytes")
    report.add_bound(f"page puts: {puts.us_per_block:.1f} us a page through the manager ("
                     f"{min(puts.cpu_seconds) / puts.nblocks * 1e6:.1f} us of CPU, all threads), "
                     f"{memcpy.us_per_block:.2f} us to copy it")


def add_ratios(report: Report, plan: Plan) -> None:
    for name, (config, meaning) in RATIOS.items():
        rows = [r for r in report.rows if r["config"] == config and r["block_bytes"] >= RATIO_MIN_BLOCK]
        worst = min(rows, key=lambda r: r["vs_limit"])
        meaning = meaning.format(batch=plan.batch, io=IO_THREADS)
        report.add_ratio(name, worst["vs_limit"], TARGETS.get(name),
                         f"{meaning}; worst over blocks >= 256 KiB (at {format_size(worst['block_bytes'])})")
        for row in rows:
            if name in TARGETS and row["vs_limit"] < TARGETS[name]:
                report.add_bound(
                    f"{config} at {format_size(row['block_bytes'])}: {row['value']} GB/s = {row['vs_limit']} of "
                    f"{row['limit_config']} ({row['limit_gbps']} GB/s), below {TARGETS[name]}: each block costs "
                    f"{row['us_per_block']} us against {row['us_per_block'] - row['extra_us_per_block']:.1f} us "
                    f"at the limit, +{row['extra_us_per_block']} us per block")


def add_limit_bounds(report: Report, plan: Plan, workdir: Path, backend: str) -> None:
    fstype, device, _ = filesystem(workdir)
    best = {c: max(r["value"] for r in report.rows if r["config"] == c) for c in ("memcpy", "raw-write-1t",
            "raw-write-4t", "raw-read-1t", "raw-read-4t")}
    report.add_bound(f"host: memcpy = one torch copy_ of {format_size(plan.total)} with {torch.get_num_threads()} "
                     f"torch threads, best {best['memcpy']} GB/s; limits cpu-gather and manager-gather, which "
                     f"copy every byte once")
    report.add_bound(f"disk: O_DIRECT on {fstype} ({device}), {format_size(RAW_CHUNK)} per call, best raw write "
                     f"{best['raw-write-1t']} / {best['raw-write-4t']} GB/s and read {best['raw-read-1t']} / "
                     f"{best['raw-read-4t']} GB/s with 1 / 4 threads; limits nvme-write and nvme-read "
                     f"(store backend: {backend})")
    report.add_bound(f"each path ran {plan.rounds} rounds interleaved with its limits; ratio = best round / best "
                     f"round; 'paired med' = median over rounds of path / limit in the same round (less sensitive "
                     f"to load drift); cpu s/GB = process CPU time of all threads per 1e9 bytes (least over rounds)")


TABLE_COLUMNS = (("block_bytes", "block"), ("config", "path"), ("value", "GB/s"), ("limit_gbps", "limit GB/s"),
                 ("vs_limit", "ratio"), ("vs_limit_paired_median", "paired med"), ("us_per_block", "us/block"),
                 ("extra_us_per_block", "+us/block"), ("cpu_s_per_gb", "cpu s/GB"))


def table_formats() -> dict[str, Callable[[object], str]]:
    return {"block_bytes": lambda v: format_size(v).replace(".0 ", " ")}


# -- command line -----------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=Help)
    parser.add_argument("--quick", action="store_true", help="256 KiB and 1 MiB blocks, 256 MiB each (~1 min)")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    parser.add_argument("--dir", type=Path, default=Path.cwd(),
                        help="where the temporary files go; must be a real disk, not tmpfs (default: .)")
    parser.add_argument("--total", help="bytes moved per path and block size (default 1GiB, quick 256MiB)")
    parser.add_argument("--rounds", type=whole(1), help="rounds per path, best counts (default 5, quick 3)")
    parser.add_argument("--pages", help="bytes of random 12 KiB pages read per round (default 256MiB, quick 64MiB)")
    parser.add_argument("--batch", type=whole(1), default=64, help="blocks per NvmeTier / manager call (default 64)")
    parser.add_argument("--threads", type=whole(1), help="torch intra-op threads (default: torch's own choice)")
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    total = parse_size(args.total or ("256MiB" if args.quick else "1GiB"), "--total")
    if total < max(sizes) or total % max(sizes):
        raise SystemExit(f"--total={total}: must be a multiple of the largest block ({max(sizes)} bytes)")
    pages = parse_size(args.pages or ("64MiB" if args.quick else "256MiB"), "--pages")
    if pages < 4 * PAGES_PER_READ * PAGE:
        raise SystemExit(f"--pages={pages}: at least {format_size(4 * PAGES_PER_READ * PAGE)} (4 reads)")
    return Plan(sizes, total, args.rounds or (3 if args.quick else 5), args.batch, pages)


def make_workdir(base: Path, plan: Plan) -> Path:
    """A fresh directory under ``base`` on a real disk with room for one raw file and one store."""
    base.mkdir(parents=True, exist_ok=True)
    fstype, device, mount = filesystem(base)
    if fstype in RAMDISKS:
        raise SystemExit(f"--dir={base} is on {fstype} ({mount}): disk numbers would measure RAM; "
                         f"pass --dir on a real disk")
    stat = os.statvfs(base)
    need = 2 * plan.total + 256 * MiB
    if stat.f_bavail * stat.f_frsize < need:
        raise SystemExit(f"--dir={base}: {format_size(stat.f_bavail * stat.f_frsize)} free, "
                         f"needs {format_size(need)}")
    return Path(tempfile.mkdtemp(prefix=".tierkv-bench-", dir=base))


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    plan = make_plan(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the temp files still go
    workdir = make_workdir(args.dir, plan)
    report = Report("tiers", args.quick, machine(workdir))
    started = time.perf_counter()
    try:
        backend = ""
        for block in plan.sizes:
            probes, backend = measure_size(block, plan, workdir)
            add_rows(report, block, probes, backend)
        add_page_rows(report, measure_pages(plan, workdir))
        add_ratios(report, plan)
        add_limit_bounds(report, plan, workdir, backend)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = round(time.perf_counter() - started, 1)
    report.add_bound(f"load: 1-min load average {report.machine['load_avg_1m']} at start, "
                     f"{os.getloadavg()[0]:.2f} at end, on {report.machine['threads']} CPUs; above the CPU count "
                     f"other processes take turns with the I/O and copy threads and every ratio here swings")
    if args.out:
        report.write_json(args.out)
    report.print_table(TABLE_COLUMNS, table_formats())
    return report


if __name__ == "__main__":
    main()
