"""An access trace: which blocks each step and layer of a run stored and read, with when and how long.

A trace is columns (`tierkv.profile.access_file` documents them and the file)
over steps, calls (ops) and the blocks of each call; `AccessRecorder`
(`tierkv.profile.access`) records one during a run, the replay
(`tierkv.tune.replay`) runs one without the model. The helpers here answer
what the run saw: which tier served the reads, hit rates, time blocked.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tierkv.errors import ConfigError
from tierkv.profile.access_file import COLUMNS, not_a_trace, read_columns, write_columns
from tierkv.tiers.base import Medium

if TYPE_CHECKING:  # profile sits below the manager: no import at run time
    from tierkv.manager.manager import TierManager

ARRIVING = 254   # ``where``: no copy yet, a move into some tier is in flight
NOWHERE = 255    # ``where``: stored nowhere, or recorded without a manager
STEP_KINDS = ("prefill", "decode")
MAX_SLOTS = 2**40                # a tier's slots in a trace's header: more is no tier a run could have had
ENGINES = ("dense", "sparse")   # what recorded a trace: tierkv.model.engine or tierkv.model.sparse_engine


class OpKind(enum.IntEnum):
    PUT = 0     # the caller stored one block
    GET = 1     # the caller read (acquired) a group of blocks
    GUESS = 2   # a prefetcher guessed the layer reads these blocks (no call to the manager)


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
                                                        # "devices" (link_stats, device_stats), and may
                                                        # say its "engine" (one of ENGINES)
    sources: tuple[str, ...] = ()     # the prefetchers whose guesses the trace holds (op_source indexes it)

    def __post_init__(self) -> None:
        if isinstance(self.block_bytes, bool) or not (isinstance(self.block_bytes, int) and self.block_bytes > 0):
            raise ConfigError(f"block_bytes={self.block_bytes!r}: must be a positive integer")
        if not self.tiers or not all(type(t.slots) is int and 1 <= t.slots <= MAX_SLOTS for t in self.tiers):
            raise ConfigError(f"tiers={self.tiers!r}: need at least one tier, each with 1 to {MAX_SLOTS} slots")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"tiers named {names}: each tier needs a name of its own")
        media = {m.value for m in Medium}
        if bad := [t.medium for t in self.tiers if t.medium not in media]:
            raise ConfigError(f"tier medium {bad[0]!r}: allowed: {', '.join(sorted(media))}")
        if self.read_tier is not None and self.read_tier not in names:
            raise ConfigError(f"read_tier={self.read_tier!r}: not one of the tiers {', '.join(names)}")
        if not (len(self.sources) < 256 and all(isinstance(n, str) and n for n in self.sources)):
            raise ConfigError(f"sources={self.sources!r}: at most 255 prefetcher names, each non-empty")
        if self.info.get("engine", ENGINES[0]) not in ENGINES:
            raise ConfigError(f"info engine={self.info['engine']!r}: allowed: {', '.join(ENGINES)}")

    @property
    def engine(self) -> str:
        """The engine that recorded the trace: as the run said, else "sparse" when it holds guesses."""
        return self.info.get("engine") or ENGINES[bool(self.sources)]

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
        raw["sources"] = tuple(raw.get("sources", ()))
        return cls(**raw)


@dataclass(frozen=True, slots=True)
class Op:
    """One recorded call: a put of one block or a get (acquire) of a group; or a guess."""

    index: int
    kind: OpKind
    step: int
    layer: int | None
    blocks: np.ndarray      # dense ids
    time: float
    blocked: float
    source: str = ""        # a guess: the prefetcher that made it


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
    op_source: np.ndarray | None = None   # None: no guesses (zeros), as in a version 1 file

    def __post_init__(self) -> None:
        if self.op_source is None:
            object.__setattr__(self, "op_source", np.zeros(len(self.op_kind)))
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
            layer, kind = int(self.op_layer[i]), OpKind(int(self.op_kind[i]))
            source = self.meta.sources[int(self.op_source[i])] if kind is OpKind.GUESS else ""
            yield Op(i, kind, int(self.op_step[i]), None if layer < 0 else layer, self.block[start[i]:start[i + 1]],
                     float(self.op_time[i]), float(self.op_blocked[i]), source)

    def guesses(self, source: str) -> np.ndarray:
        """Indices of the guess ops ``source`` made, in order (none when the trace holds none of it)."""
        if source not in self.meta.sources:
            return np.zeros(0, dtype=np.int64)
        mine = (self.op_kind == OpKind.GUESS) & (self.op_source == self.meta.sources.index(source))
        return np.flatnonzero(mine)

    def problem(self) -> str | None:
        """What is inconsistent between the columns, or None."""
        checks = (
            (len({len(getattr(self, c)) for c in ("op_kind", "op_step", "op_layer", "op_count", "op_time",
                                                  "op_blocked", "op_source")}) == 1, "op columns differ in length"),
            (len({len(self.step_kind), len(self.step_tokens), len(self.step_time)}) == 1,
             "step columns differ in length"),
            (len(self.block) == len(self.where), "block and where differ in length"),
            (int(self.op_count.sum(dtype=np.int64)) == len(self.block), "op_count does not add up to the blocks"),
            (len(self.layer_start) == self.n_steps * self.meta.layers, "layer_start is not steps x layers"),
            (not len(self.op_kind) or int(self.op_kind.max()) <= OpKind.GUESS, "op_kind holds an unknown kind"),
            (_sources_ok(self.op_kind, self.op_source, len(self.meta.sources)), "op_source names no source"),
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
        """Per tier, fastest first: the share of the blocks looked for there (not in a faster tier) it held;
        a tier no block was looked for in has none."""
        served = self.served(steps)
        left = sum(served.values())
        rates = {}
        for tier in self.meta.tiers:
            if left:
                rates[tier.name] = served[tier.name] / left
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
        """Write the trace as `tierkv.profile.access_file` lays it out."""
        write_columns(path, self.meta.as_dict(), {name: getattr(self, name) for name in COLUMNS})

    @classmethod
    def read(cls, path: str | Path) -> AccessTrace:
        """Read and validate a trace; a malformed or truncated file raises ConfigError naming it."""
        meta, arrays = read_columns(path, _meta_of)
        try:
            return cls(meta, **arrays)
        except ConfigError as err:
            raise not_a_trace(path, str(err).removeprefix("access trace: ")) from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AccessTrace):
            return NotImplemented
        return self.meta == other.meta and all(
            np.array_equal(getattr(self, n), getattr(other, n), equal_nan=COLUMNS[n] == "<f8") for n in COLUMNS)

    __hash__ = None  # type: ignore[assignment]


def _meta_of(raw: Any) -> TraceMeta:
    """The header's meta as a TraceMeta; ConfigError says what is missing or wrong."""
    try:
        return TraceMeta.from_dict(raw)
    except (KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"the header's meta is incomplete or has unknown fields ({err})") from None
    except ConfigError as err:
        raise ConfigError(f"the header's meta: {err}") from None


def _sources_ok(kinds: np.ndarray, sources: np.ndarray, named: int) -> bool:
    guesses = sources[kinds == OpKind.GUESS]
    return not len(guesses) or int(guesses.max()) < named


def _where_ok(where: np.ndarray, tiers: int) -> bool:
    return bool(np.all((where < tiers) | (where >= ARRIVING)))


def _policy_name(policy: object) -> str:
    """The registered name of this instance's class (or the one it stands in for, ``registered_as``), else
    its ``module:Class`` (``make_policy`` takes both)."""
    from policies import available, make_policy  # a sibling package: only when a manager is described

    cls = type(policy)
    if isinstance(getattr(policy, "registered_as", None), str):
        return policy.registered_as  # type: ignore[attr-defined]
    return next((name for name in available() if type(make_policy(name)) is cls),
                f"{cls.__module__}:{cls.__qualname__}")
