"""Process-wide I/O and threading knobs (and only those) come from the environment:

=========================  ========  ===============================================
variable                   default   meaning
=========================  ========  ===============================================
TIERKV_IO_THREADS          4         worker threads of the NVMe tier (O_DIRECT/buffered)
TIERKV_NVME_BACKEND        auto      force a backend: auto, kvikio, odirect, buffered
TIERKV_NVME_AIO            1         0: O_DIRECT reads on the worker threads, not by native AIO
TIERKV_COPY_THREADS        2         worker threads for host/device copies
TIERKV_INFLIGHT_BYTES      256MiB    bytes the manager keeps in flight at most
TIERKV_SWITCH_INTERVAL     0.0005    seconds: the interpreter's thread switch interval the tierkv
                                     command sets (the library leaves it as it is)
TIERKV_MALLOC_KEEP         64MiB     freed heap memory glibc may keep for reuse in the tierkv command
                                     (its trim threshold; blocks under half of it, at most 32 MiB,
                                     come from the heap, not from mmap); 0: glibc's own behaviour
TIERKV_MALLOC_ARENAS       2         glibc heaps (arenas) the tierkv command's threads share, each
                                     keeping its own freed memory; 0: glibc's own (8 per core)
TIERKV_CACHE_DIR           ~/.cache/tierkv  converted models (GGUF -> safetensors) under models/
=========================  ========  ===============================================
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from dataclasses import dataclass, field, fields
from collections.abc import Callable
from typing import Any

from tierkv.errors import ConfigError
from tierkv.sizes import parse_size


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")


@dataclass(frozen=True, slots=True)
class IOKnobs:
    """Process-wide I/O knobs, read from ``TIERKV_*`` (see the table above)."""

    io_threads: int = 4
    nvme_backend: str = "auto"
    nvme_aio: bool = True
    copy_threads: int = 2
    inflight_bytes: int = 256 * 1024**2
    # a hop from the model's thread to the manager's loop waits for the interpreter's lock while an I/O
    # or copy thread holds it, up to this long (Python's default 5 ms; at 1M tokens 0.5 ms gave ~9 %)
    switch_interval: float = 0.0005
    # a sparse decode step allocates and frees ~20 MB of temporaries a layer; glibc handed the freed
    # top of its heap back at once, so each layer faulted fresh pages in (bench/RESULTS.md)
    malloc_keep: int = 64 * 1024**2
    # every thread that allocates (I/O, copies, the loop, OpenMP) gets a heap of its own, each keeping
    # up to ``malloc_keep`` freed: two shared heaps took a 32K run's peak RSS 74-148 MB lower, as fast
    malloc_arenas: int = 2
    backends: tuple[str, ...] = field(default=("auto", "kvikio", "odirect", "buffered"), repr=False)

    def __post_init__(self) -> None:
        _positive("TIERKV_IO_THREADS", self.io_threads)
        _positive("TIERKV_COPY_THREADS", self.copy_threads)
        _positive("TIERKV_INFLIGHT_BYTES", self.inflight_bytes)
        if not 0 < self.switch_interval <= 1:
            raise ConfigError(f"TIERKV_SWITCH_INTERVAL={self.switch_interval}: seconds, more than 0 and at most 1")
        if self.nvme_backend not in self.backends:
            raise ConfigError(f"TIERKV_NVME_BACKEND={self.nvme_backend!r}: allowed: {', '.join(self.backends)}")
        if self.malloc_keep < 0:
            raise ConfigError(f"TIERKV_MALLOC_KEEP={self.malloc_keep}: must be >= 0 bytes (0: glibc's own)")
        if self.malloc_arenas < 0:
            raise ConfigError(f"TIERKV_MALLOC_ARENAS={self.malloc_arenas}: must be >= 0 (0: glibc's own)")

    def apply_to_process(self) -> None:
        """What the tierkv command sets for its own process (the library leaves them as they are): the
        interpreter's switch interval and, on glibc, how much freed memory malloc keeps and in how many
        heaps."""
        sys.setswitchinterval(self.switch_interval)
        if self.malloc_keep:
            keep_freed_memory(self.malloc_keep)
        if self.malloc_arenas:
            limit_heaps(self.malloc_arenas)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> IOKnobs:
        env = os.environ if env is None else env
        defaults = {f.name: f.default for f in fields(cls)}

        def number(name: str, default: Any, kind: type, expected: str) -> Any:
            raw = env.get(name)
            if raw is None:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: expected {expected}") from None

        aio = env.get("TIERKV_NVME_AIO", "1").strip().lower()
        if aio not in ("0", "1", "off", "on", "false", "true", "no", "yes"):
            raise ConfigError(f"TIERKV_NVME_AIO={env['TIERKV_NVME_AIO']!r}: allowed: 1 (native AIO reads) or 0 "
                              "(reads on worker threads)")
        return cls(
            io_threads=number("TIERKV_IO_THREADS", defaults["io_threads"], int, "an integer"),
            nvme_backend=env.get("TIERKV_NVME_BACKEND", defaults["nvme_backend"]),
            nvme_aio=aio in ("1", "on", "true", "yes"),
            copy_threads=number("TIERKV_COPY_THREADS", defaults["copy_threads"], int, "an integer"),
            inflight_bytes=parse_size(env.get("TIERKV_INFLIGHT_BYTES", defaults["inflight_bytes"]),
                                      "TIERKV_INFLIGHT_BYTES"),
            switch_interval=number("TIERKV_SWITCH_INTERVAL", defaults["switch_interval"], float,
                                   "seconds, like 0.0005"),
            malloc_keep=parse_size(env.get("TIERKV_MALLOC_KEEP", defaults["malloc_keep"]), "TIERKV_MALLOC_KEEP"),
            malloc_arenas=number("TIERKV_MALLOC_ARENAS", defaults["malloc_arenas"], int, "an integer"),
        )


MMAP_THRESHOLD_MAX = 32 * 1024**2    # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit machines


def keep_freed_memory(nbytes: int) -> bool:
    """Let glibc's malloc keep up to ``nbytes`` of freed heap for reuse (``M_TRIM_THRESHOLD``) and take
    blocks under half of it (at most 32 MiB) from the heap (``M_MMAP_THRESHOLD``); this also stops it
    moving both thresholds as it goes. False where the C library has no ``mallopt`` (not glibc)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    trim, mmap_threshold = -1, -3                  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
    kept = bool(mallopt(trim, min(nbytes, 2**31 - 1)))
    return kept and bool(mallopt(mmap_threshold, min(nbytes // 2, MMAP_THRESHOLD_MAX)))


def limit_heaps(arenas: int) -> bool:
    """At most ``arenas`` glibc heaps for the threads that allocate from now on (``M_ARENA_MAX``); heaps
    made before stay. False where the C library has no ``mallopt`` (not glibc)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(-8, arenas))     # M_ARENA_MAX (malloc.h)


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt(param, value)``, or None."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def cache_dir() -> Path:
    """Where tierkv keeps what it can rebuild: converted models, probe and calibration results,
    chat history (``TIERKV_CACHE_DIR``, default ~/.cache/tierkv)."""
    return Path(os.environ.get("TIERKV_CACHE_DIR") or Path.home() / ".cache" / "tierkv").expanduser()


def read_cache(path: Path) -> dict:
    """The JSON object cached at ``path``; {} where there is none or it is damaged (it is rebuilt)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, data: dict) -> None:
    """``data`` as JSON to ``path``, through a temporary file of this process renamed into place: two
    processes writing one cache at once leave one whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
