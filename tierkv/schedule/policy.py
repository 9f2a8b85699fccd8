"""A FlexGen-style offload policy: where weights, KV cache and activations live, and the batch shape.

A policy is a frozen value. Placement is a split of bytes over the three tiers::

    Placement(gpu=0.2, cpu=0.5, disk=0.3)      fractions, each in [0, 1], summing to 1

    weights   a fraction of each decoder layer's weight bytes, by whole tensors (FlexGen's rule:
              a tensor goes where the midpoint of its cumulative byte range falls); the gpu
              share stays resident, the rest streams through two staging slots
    kv        a fraction of each GPU batch's KV blocks, by block position (first blocks on gpu)
    act       hidden states between layers; the runner keeps them on the compute device

A *block* of sequences is ``num_gpu_batches`` GPU batches of ``gpu_batch_size`` sequences. The
zig-zag schedule (``tierkv.schedule.plan``) loads each layer's weights once per token step and
runs every GPU batch of the block through it before moving on::

    block_size = gpu_batch_size * num_gpu_batches

``compress_kv`` stores offloaded KV as int4 (``tierkv.codec``); ``overlap``
runs loads of the next step and stores of the previous one on their own threads (streams on CUDA).
``weight_dtype`` keeps the streamed (cpu/disk) weights in a narrower dtype than the compute's
(null: the compute dtype); a load converts them as it fills a staging slot. Lossless when the
checkpoint is in that dtype (a bf16 checkpoint computed in fp32), rounding otherwise.

A policy file is JSON with the keys of `Policy.to_dict`::

    {"format": "tierkv-batch-policy", "version": 1,
     "gpu_batch_size": 8, "num_gpu_batches": 4,
     "weights": {"gpu": 0.0, "cpu": 1.0, "disk": 0.0},
     "kv": {"gpu": 0.25, "cpu": 0.75, "disk": 0.0},
     "act": {"gpu": 1.0, "cpu": 0.0, "disk": 0.0},
     "overlap": true, "compress_kv": false, "weight_dtype": "bfloat16"}
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError

POLICY_FORMAT, POLICY_VERSION = "tierkv-batch-policy", 1
TIERS = ("gpu", "cpu", "disk")
WEIGHT_DTYPES = ("bfloat16", "float16")     # storage dtypes of streamed weights (torch names)
_TOLERANCE = 1e-6


def check_weight_dtype(value: object, field: str = "weight_dtype") -> None:
    """A storage dtype of streamed weights: None (the compute dtype) or one of ``WEIGHT_DTYPES``."""
    if value is not None and value not in WEIGHT_DTYPES:
        raise ConfigError(f"{field}={value!r}: allowed: {', '.join(WEIGHT_DTYPES)} or none (the compute dtype)")


@dataclass(frozen=True, slots=True)
class Placement:
    """Fractions of some bytes on gpu, cpu and disk."""

    gpu: float = 1.0
    cpu: float = 0.0
    disk: float = 0.0

    def __post_init__(self) -> None:
        for name in TIERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"placement {name}={value!r}: expected a number in [0, 1]")
            if not -_TOLERANCE <= value <= 1 + _TOLERANCE:
                raise ConfigError(f"placement {name}={value}: must be in [0, 1]")
            object.__setattr__(self, name, min(1.0, max(0.0, float(value))))
        total = self.gpu + self.cpu + self.disk
        if abs(total - 1.0) > 1e-4:
            raise ConfigError(f"placement gpu={self.gpu:g} cpu={self.cpu:g} disk={self.disk:g}: "
                              f"the fractions must sum to 1 (they sum to {total:g})")

    def split(self, n: int) -> tuple[int, int, int]:
        """``n`` items -> how many go to (gpu, cpu, disk), first items to the fastest tier."""
        gpu = math.floor(self.gpu * n + _TOLERANCE)
        cpu = math.floor((self.gpu + self.cpu) * n + _TOLERANCE) - gpu
        return gpu, cpu, n - gpu - cpu

    def home(self, start: float, end: float) -> str:
        """The tier of an item covering ``[start, end)`` of the bytes (fractions): where its midpoint falls."""
        mid = (start + end) / 2
        if mid < self.gpu:
            return "gpu"
        return "cpu" if mid < self.gpu + self.cpu else "disk"

    def to_dict(self) -> dict[str, float]:
        return {name: round(getattr(self, name), 6) for name in TIERS}

    @classmethod
    def from_dict(cls, data: Any, field: str) -> Placement:
        if not isinstance(data, dict) or set(data) - set(TIERS):
            raise ConfigError(f"policy {field}={data!r}: expected an object with keys gpu, cpu, disk")
        return cls(**{name: data.get(name, 0.0) for name in TIERS})


@dataclass(frozen=True, slots=True)
class Policy:
    gpu_batch_size: int
    num_gpu_batches: int
    weights: Placement = Placement()
    kv: Placement = Placement()
    act: Placement = Placement()
    overlap: bool = True
    compress_kv: bool = False
    weight_dtype: str | None = None     # None: streamed weights stay in the compute dtype

    def __post_init__(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"policy {name}={value!r}: must be a positive integer")
        for name in ("weights", "kv", "act"):
            if not isinstance(getattr(self, name), Placement):
                raise ConfigError(f"policy {name}={getattr(self, name)!r}: expected a Placement")
        for name in ("overlap", "compress_kv"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"policy {name}={getattr(self, name)!r}: expected true or false")
        check_weight_dtype(self.weight_dtype, "policy weight_dtype")

    @property
    def block_size(self) -> int:
        """Sequences that share one pass over the weights."""
        return self.gpu_batch_size * self.num_gpu_batches

    def describe(self) -> str:
        """One line: ``bs=8x4 weights g/c/d=0/100/0 % kv=25/75/0 % overlap 4bit``."""
        def pct(p: Placement) -> str:
            return "/".join(f"{100 * getattr(p, t):.0f}" for t in TIERS)
        flags = ("overlap" if self.overlap else "serial") + (" int4-kv" if self.compress_kv else "") \
            + (f" {self.weight_dtype}-weights" if self.weight_dtype else "")
        return (f"gpu batch {self.gpu_batch_size} x {self.num_gpu_batches} batches; weights g/c/d "
                f"{pct(self.weights)} %, kv {pct(self.kv)} %, act {pct(self.act)} %; {flags}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": POLICY_FORMAT, "version": POLICY_VERSION,
                "gpu_batch_size": self.gpu_batch_size, "num_gpu_batches": self.num_gpu_batches,
                "weights": self.weights.to_dict(), "kv": self.kv.to_dict(), "act": self.act.to_dict(),
                "overlap": self.overlap, "compress_kv": self.compress_kv, "weight_dtype": self.weight_dtype}

    @classmethod
    def from_dict(cls, data: Any) -> Policy:
        if not isinstance(data, dict):
            raise ConfigError(f"policy: expected a JSON object, got {type(data).__name__}")
        if data.get("format", POLICY_FORMAT) != POLICY_FORMAT:
            raise ConfigError(f"policy format={data.get('format')!r}: expected {POLICY_FORMAT!r}")
        version = data.get("version", POLICY_VERSION)
        if isinstance(version, bool) or version != POLICY_VERSION:     # (one this tierkv cannot read, or no number)
            raise ConfigError(f"policy version={version!r}: this tierkv reads version {POLICY_VERSION} (a policy "
                              "written by another tierkv: search one again with --policy auto)")
        known = {"format", "version", "gpu_batch_size", "num_gpu_batches", "weights", "kv", "act",
                 "overlap", "compress_kv", "weight_dtype"}
        if unknown := sorted(set(data) - known):
            raise ConfigError(f"policy: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        for name in ("gpu_batch_size", "num_gpu_batches"):
            if name not in data:
                raise ConfigError(f"policy: {name} is missing (a positive integer)")
        places = {name: Placement.from_dict(data[name], name) for name in ("weights", "kv", "act") if name in data}
        return cls(gpu_batch_size=data["gpu_batch_size"], num_gpu_batches=data["num_gpu_batches"], **places,
                   overlap=data.get("overlap", True), compress_kv=data.get("compress_kv", False),
                   weight_dtype=data.get("weight_dtype"))


def read_policy(path: Path) -> Policy:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--policy {path}: no such file (give 'auto' or a policy JSON file)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--policy {path}: not a readable JSON policy ({e})") from None
    return Policy.from_dict(data)


def write_policy(policy: Policy, path: Path) -> None:
    Path(path).write_text(json.dumps(policy.to_dict(), indent=2) + "\n")
