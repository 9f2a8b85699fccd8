"""The zig-zag block schedule as a pure generator of steps.

A block of sequences runs ``num_steps`` token steps (step 0 is the prefill). Each step walks the
layers; inside a layer, every GPU batch of the block runs with the same loaded weights, so a
layer's weights cross the link once per step for the whole block, not once per batch::

    cell (t, l, b):   token step t, layer l, GPU batch b      (b fastest, then l, then t)

    t=0: (0,0,0) (0,0,1) | (0,1,0) (0,1,1) |  t=1: (1,0,0) (1,0,1) | (1,1,0) (1,1,1)
          `-- layer 0 weights --'  `-- layer 1 --'         `-- layer 0 again --' ...

Around the compute of cell n the plan issues the loads of cell n+1 and the store of cell n-1
(FlexGen's overlapped loop), and the weights of the next layer while the first batch of a layer
computes::

    load_weights t0 L0
    load_weights t0 L1        <- at batch 0 of layer 0: the next layer's weights
    compute      t0 L0 b0
    compute      t0 L0 b1
    store_kv     t0 L0 b0     <- the previous cell's new KV
    free_weights t0 L0        <- after the layer's last batch
    ...
    load_kv      t1 L0 b0     <- issued while (t0, L1, b1) computes; token steps >= 1 read KV

A KV load of ``(l, b)`` is never issued before the store of the same ``(l, b)`` one step earlier
(with a single cell per step that store comes right after its compute). Weight loads and frees
appear only when some weight bytes stream (``stream_weights``). The runner executes the steps;
nothing here touches a tensor, so the plan can be printed and checked on its own.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

from tierkv.errors import ConfigError


class Op(enum.Enum):
    LOAD_WEIGHTS = "load_weights"
    LOAD_KV = "load_kv"
    COMPUTE = "compute"
    STORE_KV = "store_kv"
    FREE_WEIGHTS = "free_weights"


@dataclass(frozen=True, slots=True, order=True)
class Cell:
    step: int
    layer: int
    batch: int


@dataclass(frozen=True, slots=True)
class Step:
    op: Op
    step: int
    layer: int
    batch: int | None = None     # None for weight steps

    @property
    def cell(self) -> Cell:
        if self.batch is None:
            raise ValueError(f"{self}: a weight step has no cell")
        return Cell(self.step, self.layer, self.batch)

    def __str__(self) -> str:
        where = f"t{self.step} L{self.layer}" + ("" if self.batch is None else f" b{self.batch}")
        return f"{self.op.value:12s} {where}"


@dataclass(frozen=True, slots=True)
class PlanShape:
    num_layers: int
    num_gpu_batches: int
    num_steps: int               # token steps: 1 prefill + (new tokens - 1) decode steps
    stream_weights: bool = True  # False when every weight byte is resident

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_gpu_batches", "num_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"plan {name}={getattr(self, name)}: must be > 0")


def cells(shape: PlanShape) -> Iterator[Cell]:
    for t in range(shape.num_steps):
        for layer in range(shape.num_layers):
            for b in range(shape.num_gpu_batches):
                yield Cell(t, layer, b)


def plan(shape: PlanShape) -> Iterator[Step]:
    """The steps of one block, in issue order (see the module docstring)."""
    order = list(cells(shape))
    stored: set[Cell] = set()
    deferred: list[Cell] = []           # KV loads waiting for their predecessor's store
    if shape.stream_weights:
        yield Step(Op.LOAD_WEIGHTS, 0, 0)
    for n, cell in enumerate(order):
        nxt = order[n + 1] if n + 1 < len(order) else None
        if shape.stream_weights and cell.batch == 0 and (ahead := _next_layer(shape, cell)) is not None:
            yield Step(Op.LOAD_WEIGHTS, *ahead)
        if nxt is not None and nxt.step > 0:
            deferred.append(nxt)
        yield from _ready_loads(deferred, stored)
        yield Step(Op.COMPUTE, cell.step, cell.layer, cell.batch)
        if n > 0:
            yield from _store(order[n - 1], stored)
        if n + 1 == len(order) or _needs_own_store(deferred, cell):
            yield from _store(cell, stored)
        yield from _ready_loads(deferred, stored)
        if shape.stream_weights and cell.batch == shape.num_gpu_batches - 1:
            yield Step(Op.FREE_WEIGHTS, cell.step, cell.layer)


def _next_layer(shape: PlanShape, cell: Cell) -> tuple[int, int] | None:
    """(step, layer) whose weights come after ``cell``'s layer, or None at the very end."""
    if cell.layer + 1 < shape.num_layers:
        return cell.step, cell.layer + 1
    return (cell.step + 1, 0) if cell.step + 1 < shape.num_steps else None


def _previous(cell: Cell) -> Cell:
    return Cell(cell.step - 1, cell.layer, cell.batch)


def _ready_loads(deferred: list[Cell], stored: set[Cell]) -> Iterator[Step]:
    while deferred and _previous(deferred[0]) in stored:
        cell = deferred.pop(0)
        yield Step(Op.LOAD_KV, cell.step, cell.layer, cell.batch)


def _needs_own_store(deferred: list[Cell], cell: Cell) -> bool:
    """A load waits on this very cell's store (one cell per step): store it now, not one cell later."""
    return any(_previous(d) == cell for d in deferred)


def _store(cell: Cell, stored: set[Cell]) -> Iterator[Step]:
    if cell not in stored:
        stored.add(cell)
        yield Step(Op.STORE_KV, cell.step, cell.layer, cell.batch)


def format_plan(steps: Iterator[Step] | list[Step]) -> str:
    return "\n".join(str(s) for s in steps)
