"""The runner: executes a plan's steps, overlapping load-next / compute / store-previous.

The runner is deliberately dumb: it walks ``plan(shape)`` in order and does what each step says.
With ``policy.overlap`` loads and stores go to their own worker threads (one for weights, one for
KV loads, one for KV stores: on CUDA each copies on its own stream) and the compute waits only
for the futures it needs::

    main thread      compute (t,l,b) ............ compute (t,l,b+1) ..........
    weights loader      load_weights (t,l+1) ...........
    kv loader        load_kv (t,l,b+1) ....
    kv storer                              store_kv (t,l,b-1) ..

Ordering the plan does not spell out, the runner enforces with futures: a KV load of (l, b)
first waits for the last store of (l, b); a compute waits for its weights and its KV.

Every step is reported to ``trace(what, step, phase)`` when it starts and when it is done
(``phase`` is "start" or "done"; ``what`` is the op's name, or "evict_kv" when a cell's loaded
KV is let go after its store), which is how tests check that nothing is used before it is loaded
or evicted before it is stored. Without overlap every step runs inline, in plan order.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierkv.model.arch import decoder_layers
from tierkv.schedule.compute import GpuBatch, finish_step, layer_forward, start_step
from tierkv.schedule.kvstore import BlockKV
from tierkv.schedule.plan import Op, PlanShape, Step, plan
from tierkv.schedule.weights import WeightStore

Trace = Callable[[str, Step, str], None]


@dataclass(slots=True)
class RunStats:
    compute_s: float = 0.0        # in layer computes (main thread)
    wait_s: float = 0.0           # the compute waited for loads
    weight_bytes: int = 0         # streamed into staging slots
    steps: int = 0                # token steps run
    step_compute_s: list[float] = field(default_factory=list)   # the latest block's compute per token step


class _Inline:
    """An executor that runs the job at once on the caller's thread (no overlap)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001  handed to whoever waits, like a thread pool
            future.set_exception(error)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


@dataclass(slots=True)
class _Block:
    """What one block's run has in flight."""

    weights: dict[tuple[int, int], tuple[int, Future]] = field(default_factory=dict)
    kv_loads: dict[tuple[int, int, int], Future] = field(default_factory=dict)
    stores: dict[tuple[int, int], Future] = field(default_factory=dict)
    new_kv: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    slot: int = 0
    bound: tuple[int, int] | None = None


class Runner:
    def __init__(self, model: nn.Module, weights: WeightStore, *, overlap: bool, group: int,
                 trace: Trace | None = None) -> None:
        self.model, self.weights, self.group = model, weights, group
        self.layers = decoder_layers(model)
        self.trace = trace or (lambda what, step, phase: None)
        make = (lambda name: ThreadPoolExecutor(1, thread_name_prefix=name)) if overlap else (lambda name: _Inline())
        self._pools = {"weights": make("tierkv-wload"), "load": make("tierkv-kvload"), "store": make("tierkv-kvstore")}
        self.stats = RunStats()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)

    # -- one block ------------------------------------------------------------
    @torch.no_grad()
    def run(self, batches: list[GpuBatch], kv: BlockKV, num_steps: int,
            stop: Callable[[], bool] | None = None) -> int:
        """Run ``num_steps`` token steps over ``batches``; ``stop()`` ends early between steps.

        Returns the token steps run.
        """
        shape = PlanShape(len(self.layers), len(batches), num_steps, stream_weights=self.weights.streams)
        state = _Block()
        done = 0
        self.stats.step_compute_s = [0.0] * num_steps
        try:
            for step in plan(shape):
                if step.op is Op.COMPUTE and step.layer == 0 and step.batch == 0:
                    if step.step > 0 and stop is not None and stop():
                        break
                    done = step.step + 1
                self._do(step, state, batches, kv)
        finally:
            self._drain(state)
        self.stats.steps += done
        return done

    def _do(self, step: Step, state: _Block, batches: list[GpuBatch], kv: BlockKV) -> None:
        t, layer, b = step.step, step.layer, step.batch
        if step.op is Op.LOAD_WEIGHTS:
            slot, state.slot = state.slot, state.slot ^ 1
            state.weights[(t, layer)] = (slot, self._submit("weights", step, self.weights.load, layer, slot))
        elif step.op is Op.LOAD_KV:
            state.kv_loads[(t, layer, b)] = self._submit("load", step, kv.load, layer, b, 1,   # room: one token
                                                         after=state.stores.get((layer, b)))
        elif step.op is Op.COMPUTE:
            self._compute(step, state, batches[b])
        elif step.op is Op.STORE_KV:
            k, v = state.new_kv.pop((t, layer, b))
            state.stores[(layer, b)] = self._submit("store", step, self._store, kv, step, k, v)
        elif step.op is Op.FREE_WEIGHTS:
            self.trace(step.op.value, step, "start")
            self.weights.unbind(layer)
            state.weights.pop((t, layer), None)
            state.bound = None
            self.trace(step.op.value, step, "done")

    def _compute(self, step: Step, state: _Block, batch: GpuBatch) -> None:
        t, layer, b = step.step, step.layer, step.batch
        if self.weights.streams and state.bound != (t, layer):
            slot, future = state.weights[(t, layer)]
            self.stats.weight_bytes += self._wait(future)
            self.weights.bind(layer, slot)
            state.bound = (t, layer)
        past = self._wait(state.kv_loads.pop((t, layer, b))) if t > 0 else None
        self.trace(step.op.value, step, "start")
        start = time.perf_counter()
        if layer == 0:
            start_step(self.model, batch, t, self.group)
        state.new_kv[(t, layer, b)] = layer_forward(self.layers[layer], batch, past)
        if layer == len(self.layers) - 1:
            finish_step(self.model, batch)
        spent = time.perf_counter() - start
        self.stats.compute_s += spent
        self.stats.step_compute_s[t] += spent
        self.trace(step.op.value, step, "done")

    def _store(self, kv: BlockKV, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        kv.store(step.layer, step.batch, k, v)
        self.trace("evict_kv", step, "done")   # the cell's working KV is let go only now

    def _submit(self, pool: str, step: Step, fn: Callable[..., Any], *args: Any,
                after: Future | None = None) -> Future:
        """Run ``fn(*args)`` on ``pool``'s thread, once ``after`` (if any) is done."""
        def job() -> Any:
            if after is not None:
                after.result()          # the step starts only now: a KV load after that cell's store
            self.trace(step.op.value, step, "start")
            result = fn(*args)
            self.trace(step.op.value, step, "done")
            return result
        return self._pools[pool].submit(job)

    def _wait(self, future: Future) -> Any:
        start = time.perf_counter()
        result = future.result()
        self.stats.wait_s += time.perf_counter() - start
        return result

    def _drain(self, state: _Block) -> None:
        """Wait for everything in flight (also after an error or an early stop); raise the first error."""
        pending = [f for _, f in state.weights.values()] + list(state.kv_loads.values()) + list(state.stores.values())
        errors = [f.exception() for f in pending if f.exception() is not None]
        state.weights.clear()
        state.kv_loads.clear()
        for layer in range(len(self.layers)):
            self.weights.unbind(layer)
        if errors:
            raise errors[0]

