"""Access traces: which blocks each step and layer stored and read, with when and how long.

An `AccessRecorder` is the tier manager's access hook (``manager.access``,
see `tierkv.manager.manager.AccessHook`); the engine also tells it where each
prefill chunk or decode step begins (``begin_step``). Blocks get dense ids in
first-seen order. At the end, ``recorder.trace(manager)`` joins what the hook
saw with the manager's events (how long the caller was blocked in each call,
when each layer began) into an `AccessTrace`, which the replay simulator
(`tierkv.tune.replay`) runs without the model.

File format, version 1, every number little-endian; no pickle anywhere::

    offset   bytes  field
    0        8      magic b"TKVTRACE"
    8        4      version, uint32 (1)
    12       4      H, the header's length in bytes, uint32
    16       H      header: UTF-8 JSON, space-padded to a multiple of 8
    16 + H   ...    the columns the header lists, in its order, each zero-padded to a multiple of 8

    header  {"format": "tierkv-access", "meta": {block_bytes, tiers: [{name, medium, slots,
             policy}], read_tier, persist, copy_threads, inflight_bytes, layers, timed, info},
             "columns": [{"name": "op_kind", "dtype": "<u1", "count": 1234}, ...],
             "checksum": xxh3_64 hex of every column byte after the header, padding included}

Columns. A call's blocks are the next ``op_count`` entries of ``block`` (CSR)::

    per step         step_kind u1 (0 prefill, 1 decode)  step_tokens u4  step_time f8
    per call (op)    op_kind u1 (0 put, 1 get)  op_step u4  op_layer i4 (-1: none)  op_count u4
                     op_time f8  op_blocked f8 (seconds the caller waited inside the call)
    per block entry  block u4 (dense id)   where u1 (index in meta.tiers of the fastest tier
                     holding the block when the call began; 254 arriving, 255 nowhere/unknown)
    per step, layer  layer_start f8 ([steps, layers] row-major; NaN: unknown)

    op i:  entries [start_i, start_i + op_count_i),  start = cumsum(op_count) - op_count

Times are seconds since the recorder was made. A call before the first
``begin_step`` belongs to step 0 (an implicit prefill step is added).
"""
from __future__ import annotations

import enum
import json
import math
import struct
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.events import Event, EventKind, busy_seconds

if TYPE_CHECKING:  # profile sits below the manager: no import at run time
    from tierkv.manager.manager import TierManager

MAGIC = b"TKVTRACE"
VERSION = 1
FORMAT = "tierkv-access"
_PREAMBLE = struct.Struct("<8sII")
ARRIVING = 254   # ``where``: no copy yet, a move into some tier is in flight
NOWHERE = 255    # ``where``: stored nowhere, or recorded without a manager
STEP_KINDS = ("prefill", "decode")

# name -> dtype, in file order; AccessTrace has one field per column, same names.
COLUMNS: dict[str, str] = {
    "step_kind": "<u1", "step_tokens": "<u4", "step_time": "<f8",
    "op_kind": "<u1", "op_step": "<u4", "op_layer": "<i4", "op_count": "<u4",
    "op_time": "<f8", "op_blocked": "<f8",
    "block": "<u4", "where": "<u1",
    "layer_start": "<f8",
}


class OpKind(enum.IntEnum):
    PUT = 0
    GET = 1


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    medium: str        # a tierkv.tiers.base.Medium value
    slots: int         # budget in blocks
    policy: str = "lru"


@dataclass(frozen=True, slots=True)
class TraceMeta:
    block_bytes: int
    tiers: tuple[TierSpec, ...]
    read_tier: str | None = None      # tier the reader acquired into; None: any memory tier, in place
    persist: bool = False             # puts were written back to the store
    copy_threads: int = 2             # the manager's executor: transfers at once ...
    inflight_bytes: int = 256 * 1024**2  # ... and bytes in flight
    layers: int = 0                   # columns of layer_start
    timed: bool = False               # op_blocked and layer_start come from the run's events
    info: dict[str, Any] = field(default_factory=dict)  # free-form; a recorded run adds "links" and
                                                        # "devices" (link_stats, device_stats)

    def __post_init__(self) -> None:
        if not (isinstance(self.block_bytes, int) and self.block_bytes > 0):
            raise ConfigError(f"block_bytes={self.block_bytes!r}: must be a positive integer")
        if not self.tiers or not all(isinstance(t.slots, int) and t.slots >= 1 for t in self.tiers):
            raise ConfigError(f"tiers={self.tiers!r}: need at least one tier, each with >= 1 slot")
        names = [t.name for t in self.tiers]
        if self.read_tier is not None and self.read_tier not in names:
            raise ConfigError(f"read_tier={self.read_tier!r}: not one of the tiers {', '.join(names)}")

    @classmethod
    def of(cls, manager: TierManager, *, read_tier: str | None = None, persist: bool | None = None,
           layers: int = 0, timed: bool = False, info: dict[str, Any] | None = None) -> TraceMeta:
        """The tiers, budgets, policies and executor limits of a running ``TierManager``."""
        tiers = tuple(TierSpec(n, manager.tiers[n].medium.value, manager.tiers[n].pool.capacity,
                               _policy_name(manager.policies[n])) for n in manager.order)
        return cls(manager.block_bytes, tiers, read_tier, manager.store is not None if persist is None else persist,
                   manager.knobs.copy_threads, manager.knobs.inflight_bytes, layers, timed, dict(info or {}))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TraceMeta:
        raw = dict(raw)
        raw["tiers"] = tuple(TierSpec(**t) for t in raw["tiers"])
        return cls(**raw)


@dataclass(frozen=True, slots=True)
class Op:
    """One recorded call: a put of one block or a get (acquire) of a group."""

    index: int
    kind: OpKind
    step: int
    layer: int | None
    blocks: np.ndarray      # dense ids
    time: float
    blocked: float


@dataclass(frozen=True, eq=False)
class AccessTrace:
    meta: TraceMeta
    step_kind: np.ndarray
    step_tokens: np.ndarray
    step_time: np.ndarray
    op_kind: np.ndarray
    op_step: np.ndarray
    op_layer: np.ndarray
    op_count: np.ndarray
    op_time: np.ndarray
    op_blocked: np.ndarray
    block: np.ndarray
    where: np.ndarray
    layer_start: np.ndarray

    def __post_init__(self) -> None:
        for name, dtype in COLUMNS.items():
            object.__setattr__(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        problem = self.problem()
        if problem:
            raise ConfigError(f"access trace: {problem}")

    # -- shape ---------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.step_kind)

    @property
    def n_ops(self) -> int:
        return len(self.op_kind)

    @property
    def n_blocks(self) -> int:
        """Distinct blocks (ids run 0..n_blocks-1)."""
        return int(self.block.max()) + 1 if len(self.block) else 0

    def op_start(self) -> np.ndarray:
        """First entry of each op in ``block``; one more element: the end."""
        return np.concatenate([[0], np.cumsum(self.op_count, dtype=np.int64)])

    def ops(self) -> Iterator[Op]:
        start = self.op_start()
        for i in range(self.n_ops):
            layer = int(self.op_layer[i])
            yield Op(i, OpKind(int(self.op_kind[i])), int(self.op_step[i]), None if layer < 0 else layer,
                     self.block[start[i]:start[i + 1]], float(self.op_time[i]), float(self.op_blocked[i]))

    def problem(self) -> str | None:
        """What is inconsistent between the columns, or None."""
        checks = (
            (len({len(getattr(self, c)) for c in ("op_kind", "op_step", "op_layer", "op_count", "op_time",
                                                  "op_blocked")}) == 1, "op columns differ in length"),
            (len({len(self.step_kind), len(self.step_tokens), len(self.step_time)}) == 1,
             "step columns differ in length"),
            (len(self.block) == len(self.where), "block and where differ in length"),
            (int(self.op_count.sum(dtype=np.int64)) == len(self.block), "op_count does not add up to the blocks"),
            (len(self.layer_start) == self.n_steps * self.meta.layers, "layer_start is not steps x layers"),
            (not len(self.op_kind) or int(self.op_kind.max()) <= OpKind.GET, "op_kind holds an unknown kind"),
            (not len(self.step_kind) or int(self.step_kind.max()) < len(STEP_KINDS), "step_kind holds an unknown kind"),
            (not len(self.op_step) or int(self.op_step.max()) < self.n_steps, "op_step points past the steps"),
            (not len(self.where) or _where_ok(self.where, len(self.meta.tiers)), "where names no tier"),
            (not len(self.block) or int(self.block.max()) < len(self.block), "block ids exceed the entries"),
        )
        return next((message for ok, message in checks if not ok), None)

    # -- what the run saw ----------------------------------------------------
    def served(self, steps: Sequence[str] = STEP_KINDS) -> dict[str, int]:
        """Blocks the gets found in each tier (the fastest holding them), plus "arriving" and "nowhere"."""
        gets = self._op_mask(OpKind.GET, steps)
        counts = np.bincount(self.where[np.repeat(gets, self.op_count)], minlength=256)
        names = {i: t.name for i, t in enumerate(self.meta.tiers)} | {ARRIVING: "arriving", NOWHERE: "nowhere"}
        return {name: int(counts[i]) for i, name in names.items()}

    def hit_rates(self, steps: Sequence[str] = STEP_KINDS) -> dict[str, float]:
        """Per tier, fastest first: the share of the blocks looked for there (not in a faster tier) it held."""
        served = self.served(steps)
        left = sum(served.values())
        rates = {}
        for tier in self.meta.tiers:
            rates[tier.name] = served[tier.name] / left if left else 0.0
            left -= served[tier.name]
        return rates

    def waited(self, kind: OpKind = OpKind.GET, steps: Sequence[str] = STEP_KINDS) -> float:
        """Seconds the caller was blocked in calls of ``kind`` during steps of ``steps``."""
        return float(self.op_blocked[self._op_mask(kind, steps)].sum())

    def _op_mask(self, kind: OpKind, steps: Sequence[str]) -> np.ndarray:
        wanted = [STEP_KINDS.index(s) for s in steps]
        in_steps = np.isin(self.step_kind[self.op_step], wanted) if self.n_steps else np.ones(self.n_ops, bool)
        return (self.op_kind == kind) & in_steps

    # -- files -----------------------------------------------------------------
    def write(self, path: str | Path) -> None:
        payload = [_padded(getattr(self, name).tobytes()) for name in COLUMNS]
        digest = xxhash.xxh3_64()
        for chunk in payload:
            digest.update(chunk)
        header = {"format": FORMAT, "meta": self.meta.as_dict(),
                  "columns": [{"name": n, "dtype": d, "count": len(getattr(self, n))} for n, d in COLUMNS.items()],
                  "checksum": digest.hexdigest()}
        text = json.dumps(header, allow_nan=False).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(_PREAMBLE.pack(MAGIC, VERSION, len(text)))
            f.write(text)
            for chunk in payload:
                f.write(chunk)

    @classmethod
    def read(cls, path: str | Path) -> AccessTrace:
        """Read and validate a trace; a malformed or truncated file raises ConfigError naming it."""
        try:
            with open(path, "rb") as f:
                return cls._parse(f, Path(path))
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the access trace: {err.strerror or err}") from None

    @classmethod
    def _parse(cls, f: Any, path: Path) -> AccessTrace:
        size = path.stat().st_size

        def bad(problem: str) -> ConfigError:
            return ConfigError(f"{path}: not a valid tierkv access trace: {problem}")

        head = f.read(_PREAMBLE.size)
        if len(head) < _PREAMBLE.size:
            raise bad(f"truncated: {size} bytes, shorter than the {_PREAMBLE.size}-byte preamble")
        magic, version, header_len = _PREAMBLE.unpack(head)
        if magic != MAGIC:
            raise bad(f"magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise bad(f"format version {version}; this tierkv reads version {VERSION}")
        header = _parse_header(f.read(header_len), header_len, bad)
        columns = header["columns"]
        expected = _PREAMBLE.size + header_len + sum(_padded_len(c["count"] * np.dtype(c["dtype"]).itemsize)
                                                     for c in columns)
        if size != expected:
            what = "truncated" if size < expected else "trailing bytes"
            raise bad(f"{what}: the header announces {expected} bytes, the file has {size}")
        digest = xxhash.xxh3_64()
        arrays: dict[str, np.ndarray] = {}
        for column in columns:
            raw = f.read(_padded_len(column["count"] * np.dtype(column["dtype"]).itemsize))
            digest.update(raw)
            arrays[column["name"]] = np.frombuffer(raw, dtype=column["dtype"], count=column["count"]).copy()
        if digest.hexdigest() != header["checksum"]:
            raise bad("the column bytes do not match the header's checksum (the file is corrupt)")
        try:
            return cls(header["meta"], **arrays)
        except ConfigError as err:
            raise bad(str(err).removeprefix("access trace: ")) from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AccessTrace):
            return NotImplemented
        return self.meta == other.meta and all(
            np.array_equal(getattr(self, n), getattr(other, n), equal_nan=COLUMNS[n] == "<f8") for n in COLUMNS)

    __hash__ = None  # type: ignore[assignment]


class AccessRecorder:
    """The manager's access hook: records every put and get, step by step.

    Calls come from the manager's loop thread (``on_put``/``on_acquire``) and
    the model's thread (``begin_step``), one at a time: each append is atomic
    under the GIL and the caller waits for the manager between calls.
    """

    def __init__(self, *, read_tier: str | None = None, clock: Callable[[], float] = time.perf_counter,
                 info: dict[str, Any] | None = None) -> None:
        self.read_tier = read_tier
        self.info = dict(info or {})
        self._clock = clock
        self.origin = clock()
        self._manager: TierManager | None = None
        self._ids: dict[BlockKey, int] = {}
        self._steps = {"kind": array("B"), "tokens": array("I"), "time": array("d")}
        self._ops = {"kind": array("B"), "step": array("I"), "layer": array("i"), "count": array("I"),
                     "time": array("d")}
        self._blocks, self._where = array("I"), array("B")

    def attach(self, manager: TierManager) -> AccessRecorder:
        """Become ``manager.access`` (a TierManager) and note where each block is when it is used."""
        self._manager = manager
        manager.access = self
        return self

    # -- the hook --------------------------------------------------------------
    def begin_step(self, kind: str, tokens: int) -> None:
        if kind not in STEP_KINDS:
            raise ValueError(f"kind={kind!r}: allowed: {', '.join(STEP_KINDS)}")
        self._add_step(STEP_KINDS.index(kind), tokens)

    def on_put(self, key: BlockKey, layer: int | None) -> None:
        self._add_op(OpKind.PUT, (key,), layer)

    def on_acquire(self, keys: Sequence[BlockKey], layer: int | None) -> None:
        self._add_op(OpKind.GET, keys, layer)

    # -- the result --------------------------------------------------------------
    def trace(self, manager: TierManager | None = None, events: Iterable[Event] | None = None,
              meta: TraceMeta | None = None) -> AccessTrace:
        """The trace so far. ``manager`` (default: the attached one) supplies the tiers and its events."""
        manager = manager if manager is not None else self._manager
        if meta is None and manager is None:
            raise ValueError("give the manager the trace was recorded on, or its TraceMeta")
        if events is None and manager is not None:
            events = manager.events.events
        events = list(events or ())
        op_time, step_time = np.array(self._ops["time"], np.float64), np.array(self._steps["time"], np.float64)
        layers = max([e.layer + 1 for e in events if e.kind == EventKind.LAYER and e.layer is not None], default=0)
        timed = any(e.kind in (EventKind.WAIT, EventKind.PUT, EventKind.LAYER) for e in events)
        if meta is None:
            meta = TraceMeta.of(manager, read_tier=self.read_tier, layers=layers, timed=timed,
                                info=self.info | {"links": link_stats(events),
                                                  "devices": device_stats(events, self._store_names(manager))})
        steps, ops = self._steps, self._ops  # copied: the recorder may go on recording
        return AccessTrace(
            meta, np.array(steps["kind"]), np.array(steps["tokens"]), step_time,
            np.array(ops["kind"]), np.array(ops["step"]), np.array(ops["layer"]), np.array(ops["count"]), op_time,
            _blocked(ops["kind"], op_time, events, self.origin),
            np.array(self._blocks), np.array(self._where), _layer_starts(step_time, meta.layers, events, self.origin))

    def save(self, path: str | Path, manager: TierManager | None = None) -> AccessTrace:
        trace = self.trace(manager)
        trace.write(path)
        return trace

    # -- internals ---------------------------------------------------------------
    def _add_step(self, kind: int, tokens: int) -> None:
        self._steps["kind"].append(kind)
        self._steps["tokens"].append(tokens)
        self._steps["time"].append(self._clock() - self.origin)

    def _add_op(self, kind: OpKind, keys: Sequence[BlockKey], layer: int | None) -> None:
        if not self._steps["kind"]:
            self._add_step(0, 0)  # calls before any begin_step: an implicit prefill step
        now = self._clock() - self.origin
        for key in keys:
            self._blocks.append(self._ids.setdefault(key, len(self._ids)))
            self._where.append(self._located(key))
        ops = self._ops
        ops["kind"].append(kind)
        ops["step"].append(len(self._steps["kind"]) - 1)
        ops["layer"].append(-1 if layer is None else layer)
        ops["count"].append(len(keys))
        ops["time"].append(now)

    @staticmethod
    def _store_names(manager: TierManager) -> tuple[str, ...]:
        return tuple(n for n in manager.order if manager.tiers[n].medium.value == "nvme")

    def _located(self, key: BlockKey) -> int:
        entry = None if self._manager is None else self._manager.directory.get(key)
        if entry is None:
            return NOWHERE
        found = next((i for i, name in enumerate(self._manager.order) if name in entry.copies), None)
        if found is not None:
            return found
        return ARRIVING if entry.arriving else NOWHERE


# -- joining the manager's events ---------------------------------------------------
TRANSFER_KINDS = ("put", "load", "prefetch", "demote", "writeback")


def link_bytes(events: Iterable[Event]) -> dict[str, int]:
    """Bytes moved per link ``src->dst`` (``new`` for blocks put by the caller), completed transfers only."""
    moved: dict[str, int] = {}
    for e in _transfers(events):
        link = f"{e.src or 'new'}->{e.dst}"
        moved[link] = moved.get(link, 0) + e.nbytes
    return dict(sorted(moved.items()))


def link_stats(events: Iterable[Event]) -> dict[str, dict[str, float]]:
    """How each link ``src->dst`` did in a run (see `transfer_stats`)."""
    groups: dict[str, list[Event]] = {}
    for e in _transfers(events):
        groups.setdefault(f"{e.src or 'new'}->{e.dst}", []).append(e)
    return {name: transfer_stats(es) for name, es in sorted(groups.items())}


def device_stats(events: Iterable[Event], devices: Sequence[str]) -> dict[str, dict[str, float]]:
    """How each device tier did in a run, reads and writes together: one device serves both."""
    moves = _transfers(events)
    return {d: transfer_stats([e for e in moves if d in (e.src, e.dst)]) for d in devices}


def transfer_stats(transfers: Sequence[Event]) -> dict[str, float]:
    """Transfers, blocks, bytes; ``busy_s`` sums each one's start-to-done time, ``union_s`` counts time
    when at least one ran (overlaps once); ``queued_s`` is the median wait from submit to start."""
    return {"transfers": len(transfers), "blocks": sum(e.blocks for e in transfers),
            "bytes": sum(e.nbytes for e in transfers), "busy_s": sum(e.done - e.start for e in transfers),
            "union_s": busy_seconds([(e.start, e.done) for e in transfers]),
            "queued_s": float(np.median([e.start - e.submit for e in transfers])) if transfers else 0.0}


def _transfers(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.kind in TRANSFER_KINDS and not e.error]


def _blocked(kinds: array, op_time: np.ndarray, events: list[Event], origin: float) -> np.ndarray:
    """Per op, how long the caller waited in it: until its ``wait`` (a get) or its ``put`` transfer ended.

    An event belongs to the last op that began before it; a get that found its
    blocks resident has no wait event and blocked nothing.
    """
    blocked = np.zeros(len(op_time))
    times = op_time.tolist()
    for e in events:
        want, at = {"wait": (OpKind.GET, e.start), "put": (OpKind.PUT, e.submit)}.get(e.kind, (None, 0.0))
        i = bisect_right(times, at - origin) - 1 if want is not None else -1
        if i >= 0 and kinds[i] == want:
            blocked[i] = max(blocked[i], e.done - origin - times[i])
    return blocked


def _layer_starts(step_time: np.ndarray, layers: int, events: list[Event], origin: float) -> np.ndarray:
    """When each step's layers began ([steps, layers] flattened), from the engine's ``layer`` events."""
    starts = np.full((len(step_time), layers), math.nan)
    times = step_time.tolist()
    for e in events:
        if e.kind == EventKind.LAYER and e.layer is not None and e.layer < layers:
            step = bisect_right(times, e.start - origin) - 1
            if step >= 0 and math.isnan(starts[step, e.layer]):
                starts[step, e.layer] = e.start - origin
    return starts.reshape(-1)


# -- file helpers ---------------------------------------------------------------------
def _padded(raw: bytes) -> bytes:
    return raw + b"\0" * (-len(raw) % 8)


def _padded_len(n: int) -> int:
    return n + (-n % 8)


def _parse_header(raw: bytes, length: int, bad: Callable[[str], ConfigError]) -> dict[str, Any]:
    if len(raw) < length:
        raise bad(f"truncated inside the {length}-byte header")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"the header is not UTF-8 JSON ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise bad(f"the header's format is not {FORMAT!r}")
    columns = header.get("columns")
    names = [c.get("name") for c in columns] if isinstance(columns, list) and all(
        isinstance(c, dict) for c in columns) else None
    if names != list(COLUMNS):
        raise bad(f"the header lists columns {names}, expected {list(COLUMNS)}")
    for column in columns:
        count = column.get("count")
        if column.get("dtype") != COLUMNS[column["name"]] or not isinstance(count, int) or count < 0:
            raise bad(f"column {column['name']!r}: dtype {column.get('dtype')!r} count {count!r}, "
                      f"expected dtype {COLUMNS[column['name']]!r} and a count >= 0")
    try:
        header["meta"] = TraceMeta.from_dict(header["meta"])
    except (KeyError, TypeError, AttributeError) as err:
        raise bad(f"the header's meta is incomplete or has unknown fields ({err})") from None
    except ConfigError as err:
        raise bad(f"the header's meta: {err}") from None
    if not isinstance(header.get("checksum"), str):
        raise bad("the header has no checksum")
    return header


def _where_ok(where: np.ndarray, tiers: int) -> bool:
    return bool(np.all((where < tiers) | (where >= ARRIVING)))


def _policy_name(policy: object) -> str:
    """The registered name of this instance's class, else its ``module:Class`` (``make_policy`` takes both)."""
    from policies import available, make_policy  # a sibling package: only when a manager is described

    cls = type(policy)
    return next((name for name in available() if type(make_policy(name)) is cls),
                f"{cls.__module__}:{cls.__qualname__}")


__all__ = ["AccessRecorder", "AccessTrace", "Op", "OpKind", "TierSpec", "TraceMeta", "link_bytes", "link_stats",
           "device_stats", "transfer_stats",
           "ARRIVING", "NOWHERE", "STEP_KINDS"]
