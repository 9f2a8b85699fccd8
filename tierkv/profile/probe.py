"""Measure this machine's links: the tier model that replay and ``tierkv tune`` price moves with.

One record per link, keyed ``src->dst`` like the profiler's tracks::

    cpu->cpu    host memcpy (numpy copy of a large buffer)
    cpu->gpu    CUDA host-to-device from pinned memory; without CUDA, the host copy the
    gpu->cpu    gpu tier really does (its arena lives in host memory)
    nvme->cpu   O_DIRECT reads of ``request_bytes`` at ``queue_depth`` threads (buffered
    cpu->nvme   I/O with fsync where the file system refuses O_DIRECT)

Each record: ``gbps`` (bytes / 1e9 / s at the given queue depth), ``latency_us``
(median of one small request alone), ``request_bytes``, ``queue_depth``, ``how``.

Results are cached in ``$TIERKV_CACHE_DIR/probe.json`` (default ~/.cache/tierkv), one
per NVMe directory; ``refresh=True`` measures again. Quick mode (the default)
moves a few hundred MiB and takes about a second.
"""
from __future__ import annotations

import errno
import itertools
import mmap
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from tierkv.device import ALIGN, has_cuda
from tierkv.errors import DiskFullError
from tierkv.knobs import cache_dir, read_cache, write_cache

VERSION = 1
CACHE_FILE = "probe.json"
SMALL = ALIGN   # the request whose latency is measured


@dataclass(frozen=True, slots=True)
class ProbeSize:
    copy_bytes: int          # buffer copied by the memory links
    file_bytes: int          # file written then read by the disk links
    request_bytes: int       # one disk request
    queue_depth: int         # disk requests in flight
    latency_samples: int     # small requests timed one at a time
    min_seconds: float       # each bandwidth is the best of repeats lasting at least this


QUICK = ProbeSize(32 * 2**20, 64 * 2**20, 2**20, 4, 64, 0.1)
FULL = ProbeSize(256 * 2**20, 1024 * 2**20, 4 * 2**20, 8, 512, 1.0)


def probe_links(nvme_dir: Path | None = None, *, quick: bool = True, refresh: bool = False,
                cache_dir: Path | None = None) -> dict[str, object]:
    """The links of this machine, from the cache unless ``refresh`` (or a quick result when full is asked)."""
    path = cache_path(cache_dir)
    key = str(Path(nvme_dir).resolve()) if nvme_dir is not None else ""
    cached = _read_cache(path)
    hit = cached.get(key)
    if hit is not None and not refresh and (quick or not hit.get("quick", True)):
        return hit
    result = measure_links(nvme_dir, quick=quick)
    cached[key] = result
    _write_cache(path, cached)
    return result


def cached_links(nvme_dir: Path | None = None, cache_dir: Path | None = None) -> dict[str, object] | None:
    """This machine's links as last measured, without measuring: for a run's trace, so that ``tierkv
    profile`` shows each link's GB/s next to its limit. The disk links only where ``nvme_dir`` itself was
    probed (another directory may be another disk); None where nothing was measured on this host."""
    host = socket.gethostname()
    cached = {key: hit for key, hit in _read_cache(cache_path(cache_dir)).items()
              if isinstance(hit, dict) and hit.get("host") == host and isinstance(hit.get("links"), dict)}
    key = str(Path(nvme_dir).resolve()) if nvme_dir is not None else ""
    if key in cached:
        return {"measured_at": cached[key].get("measured_at"), "links": cached[key]["links"]}
    newest = max(cached.values(), key=lambda hit: str(hit.get("measured_at")), default=None)
    if newest is None:
        return None
    memory = {name: link for name, link in newest["links"].items() if "nvme" not in name}
    return {"measured_at": newest.get("measured_at"), "links": memory}


def measure_links(nvme_dir: Path | None, *, quick: bool = True) -> dict[str, object]:
    size = QUICK if quick else FULL
    links = {"cpu->cpu": memcpy_link(size)} | device_links(size)
    if nvme_dir is not None:
        links |= disk_links(Path(nvme_dir), size)
    return {"version": VERSION, "quick": quick, "host": socket.gethostname(),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "nvme_dir": None if nvme_dir is None else str(nvme_dir), "links": links}


def cache_path(root: Path | None = None) -> Path:
    return Path(root or cache_dir()).expanduser() / CACHE_FILE


def link_lines(result: dict[str, object]) -> list[str]:
    """One line per link, for ``tierkv info --probe``."""
    lines = []
    for name, link in result["links"].items():
        lines.append(f"{name:10s} {link['gbps']:7.2f} GB/s  {link['latency_us']:8.1f} us/request  "
                     f"({link['how']})")
    return lines


# -- memory links ------------------------------------------------------------
def memcpy_link(size: ProbeSize) -> dict[str, object]:
    src = np.ones(size.copy_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    small_src, small_dst = src[:SMALL], dst[:SMALL]
    return _link(_best_rate(lambda: np.copyto(dst, src), size.copy_bytes, size.min_seconds),
                 _median_us(lambda: np.copyto(small_dst, small_src), size.latency_samples),
                 size.copy_bytes, 1, "host memcpy (numpy)")


def device_links(size: ProbeSize) -> dict[str, dict[str, object]]:
    """cpu->gpu and gpu->cpu: CUDA copies from pinned memory, or host copies without CUDA."""
    cuda = has_cuda()
    host = torch.empty(size.copy_bytes, dtype=torch.uint8, pin_memory=cuda)
    device = torch.empty_like(host, device="cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    how = "CUDA copy, pinned host memory" if cuda else "host copy (no CUDA: the gpu tier lives in host memory)"
    links = {}
    for name, dst, src in (("cpu->gpu", device, host), ("gpu->cpu", host, device)):
        def copy(d=dst, s=src) -> None:
            d.copy_(s, non_blocking=cuda)
            sync()

        def copy_small(d=dst[:SMALL], s=src[:SMALL]) -> None:
            d.copy_(s, non_blocking=cuda)
            sync()

        links[name] = _link(_best_rate(copy, size.copy_bytes, size.min_seconds),
                            _median_us(copy_small, size.latency_samples), size.copy_bytes, 1, how)
    return links


# -- disk links ---------------------------------------------------------------
def disk_links(directory: Path, size: ProbeSize) -> dict[str, dict[str, object]]:
    """cpu->nvme and nvme->cpu through a temporary file in ``directory`` (or, before it exists, its
    nearest existing parent: the same file system), removed afterwards; nothing is left behind."""
    fd, path = tempfile.mkstemp(prefix=".tierkv-probe-", dir=_existing(directory))
    os.close(fd)
    try:
        fd, direct = _open(path)
        try:
            return _measure_disk(fd, direct, size)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            raise DiskFullError(errno.ENOSPC, f"{directory}: no room for the disk probe's test file (a few MiB; "
                                "the store needs more): free space there, or give another directory") from None
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _open(path: str) -> tuple[int, bool]:
    """An fd on ``path``: O_DIRECT where the file system allows it, else buffered."""
    flags = os.O_RDWR | os.O_CLOEXEC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct), True
        except OSError:
            pass
    return os.open(path, flags), False


def _measure_disk(fd: int, direct: bool, size: ProbeSize) -> dict[str, dict[str, object]]:
    requests = size.file_bytes // size.request_bytes
    buffers = [_aligned(size.request_bytes) for _ in range(size.queue_depth)]
    for buf in buffers:
        buf[:] = 7
    small = _aligned(SMALL)
    sync = (lambda: None) if direct else (lambda: os.fsync(fd))
    how = (f"{'O_DIRECT' if direct else 'buffered + fsync'}, {size.request_bytes // 2**10} KiB requests, "
           f"{size.queue_depth} threads")
    with ThreadPoolExecutor(size.queue_depth) as pool:
        def run(io: Callable[[int, np.ndarray, int], int]) -> None:
            jobs = [pool.submit(io, fd, buffers[i % size.queue_depth], i * size.request_bytes)
                    for i in range(requests)]
            for job in jobs:
                job.result()
            sync()

        write = _best_rate(lambda: run(_pwrite), size.file_bytes, size.min_seconds)
        read = _best_rate(lambda: run(_pread), size.file_bytes, size.min_seconds)
    offsets = np.random.default_rng(0).integers(0, size.file_bytes // SMALL, size.latency_samples) * SMALL
    samples = itertools.cycle(offsets.tolist())
    read_us = _median_us(lambda: _pread(fd, small, next(samples)), size.latency_samples)
    write_us = _median_us(lambda: (_pwrite(fd, small, next(samples)), sync()), size.latency_samples)
    return {"cpu->nvme": _link(write, write_us, size.request_bytes, size.queue_depth, how),
            "nvme->cpu": _link(read, read_us, size.request_bytes, size.queue_depth, how)}


def _aligned(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)  # page-aligned: O_DIRECT accepts it


def _pwrite(fd: int, buf: np.ndarray, offset: int) -> int:
    done = os.pwritev(fd, [buf], offset)
    if done != buf.nbytes:                # a file system writes less than asked only where it is full
        raise OSError(errno.ENOSPC, f"short write: {done} of {buf.nbytes} bytes at offset {offset}")
    return done


def _pread(fd: int, buf: np.ndarray, offset: int) -> int:
    done = os.preadv(fd, [buf], offset)
    if done != buf.nbytes:
        raise OSError(f"short read: {done} of {buf.nbytes} bytes at offset {offset}")
    return done


# -- timing -------------------------------------------------------------------
def _best_rate(fn: Callable[[], object], nbytes: int, min_seconds: float) -> float:
    """GB/s of the fastest of at least three runs that together last ``min_seconds``."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or spent < min_seconds:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return nbytes / max(best, 1e-9) / 1e9


def _median_us(fn: Callable[[], object], samples: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _link(gbps: float, latency_us: float, request_bytes: int, queue_depth: int, how: str) -> dict[str, object]:
    return {"gbps": round(gbps, 3), "latency_us": round(latency_us, 2), "request_bytes": request_bytes,
            "queue_depth": queue_depth, "how": how}


# -- cache ---------------------------------------------------------------------
def _read_cache(path: Path) -> dict[str, dict[str, object]]:
    data = read_cache(path)
    return dict(data.get("results", {})) if data.get("version") == VERSION else {}


def _write_cache(path: Path, results: dict[str, dict[str, object]]) -> None:
    write_cache(path, {"version": VERSION, "results": results})
