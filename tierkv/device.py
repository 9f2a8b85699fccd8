"""Capability shim: the same code runs with and without CUDA.

Without CUDA, ``torch.cuda.Stream``/``Event`` and ``pin_memory=True`` raise.
Here they become a null stream (work runs inline on the calling thread), a
null event (always complete) and plain host memory, so every path that runs
on a GPU machine also runs, and is tested, on a CPU-only one.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator

import torch

ALIGN = 4096  # O_DIRECT wants buffer addresses, offsets and lengths in these units


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ALIGN (a block's size on every tier)."""
    return -(-nbytes // ALIGN) * ALIGN


GDS_INSTALL = "pip install 'tierkv-runtime[gds]' (CUDA 12) or 'tierkv-runtime[gds-cu13]' (CUDA 13)"
"""How kvikio, the GDS backend, gets installed: the extra that matches the CUDA major version."""


@functools.cache
def has_cuda() -> bool:
    return torch.cuda.is_available()


@functools.cache
def has_cuda_driver() -> bool:
    """True when libcuda loads (kvikio needs it even for host buffers)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def compute_device() -> torch.device:
    return torch.device("cuda") if has_cuda() else torch.device("cpu")


def native_bf16() -> str | None:
    """What computes bf16 natively here (a CUDA device with bf16, AMX, AVX512-BF16), or None: an AVX2 CPU
    converts bf16 at every matmul, several times slower than fp32. Detected, never assumed."""
    if torch.cuda.is_available():
        return "CUDA bf16" if torch.cuda.is_bf16_supported() else None
    for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
        if getattr(torch.cpu, probe, lambda: False)():
            return name
    return None


def auto_dtype() -> torch.dtype:
    """The compute dtype ``--dtype auto`` picks: bf16 where it is native (`native_bf16`), fp32 elsewhere."""
    return torch.bfloat16 if native_bf16() else torch.float32


class NullEvent:
    """Stands in for ``torch.cuda.Event``: host work is complete when recorded."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class NullStream:
    """Stands in for ``torch.cuda.Stream``: work on it runs inline."""

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


def new_stream(device: torch.device) -> torch.cuda.Stream | NullStream:
    return torch.cuda.Stream(device) if device.type == "cuda" else NullStream()


def new_event(device: torch.device) -> torch.cuda.Event | NullEvent:
    return torch.cuda.Event() if device.type == "cuda" else NullEvent()


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | NullStream) -> Iterator[None]:
    if isinstance(stream, NullStream):
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` whose data starts on an ALIGN boundary.

    Pinned only when asked and CUDA exists. The over-allocation stays alive as
    the returned view's base.
    """
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned and has_cuda())
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


class StagingPool:
    """Reusable aligned host buffers of one size (pinned where CUDA exists), for the copies between a
    CUDA tier and the disk that bounce through host memory: a read takes buffers, uses them and gives
    them back, instead of pinning fresh memory per block per read (pinning costs far more than the
    copy). Holds at most ``keep`` idle buffers; more are made when many are out at once."""

    def __init__(self, nbytes: int, *, keep: int = 64) -> None:
        self.nbytes, self.keep = nbytes, keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.made = 0

    @contextlib.contextmanager
    def take(self, count: int) -> Iterator[list[torch.Tensor]]:
        with self._lock:
            got, self._idle = self._idle[:count], self._idle[count:]
            self.made += count - len(got)
        fresh = [host_buffer(self.nbytes, pinned=True) for _ in range(count - len(got))]
        buffers = got + fresh
        try:
            yield buffers
        finally:
            with self._lock:
                self._idle.extend(buffers[:max(0, self.keep - len(self._idle))])


_STAGING: dict[int, StagingPool] = {}
_STAGING_LOCK = threading.Lock()


def staging_pool(nbytes: int) -> StagingPool:
    """The process's staging pool for buffers of ``nbytes``."""
    with _STAGING_LOCK:
        pool = _STAGING.get(nbytes)
        if pool is None:
            pool = _STAGING[nbytes] = StagingPool(nbytes)
        return pool
