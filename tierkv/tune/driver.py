"""The replay's driver: a trace's calls to the tier manager, at their virtual times.

Time, per op i of the trace::

    compute_i = op_time[i] - (op_time[i-1] + op_blocked[i-1])   the run's own time between ops
    start_i   = end_{i-1} + compute_i * compute_scale[step kind]  virtual clock
    end_i     = when the manager returns (start_i if nothing had to move)

A put or a get is a call to the manager; a guess is none (the recorded
engine's prefetcher only named blocks then): it marks a time at which a
prefetch may be issued. Prefetches planned at op i (`tierkv.tune.prefetchers`)
are issued ``lead`` seconds before it starts, never before op i-1 ended. A
reader holds the blocks of its last get until its next call or prefetch.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict

import numpy as np
import torch

from tierkv.keys import BlockKey
from tierkv.manager.lease import Lease
from tierkv.manager.manager import TierManager
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import STEP_KINDS, AccessTrace, Op, OpKind
from tierkv.tune.prefetchers import Prefetch


def compute_gaps(trace: AccessTrace) -> np.ndarray:
    """Per op, the run's own time from the end of the previous op (or the first step) to this one."""
    if not trace.n_ops:
        return np.zeros(0)
    origin = trace.step_time[0] if trace.n_steps else trace.op_time[0]
    ends = np.concatenate([[origin], (trace.op_time + trace.op_blocked)[:-1]])
    return np.maximum(trace.op_time - ends, 0.0)


def block_key(block: int) -> BlockKey:
    """The key a replay gives the trace's dense block id."""
    return BlockKey(int(block).to_bytes(16, "little"))


class Driver:
    def __init__(self, trace: AccessTrace, manager: TierManager, seen: AccessRecorder,
                 plan: list[Prefetch], scale: np.ndarray) -> None:
        """``seen`` records what the replayed manager sees; ``scale`` multiplies each op's compute."""
        self.trace, self.manager, self.seen, self.scale = trace, manager, seen, scale
        self.keys = [block_key(i) for i in range(trace.n_blocks)]
        self.start = trace.op_start()
        self.plan: dict[int, list[Prefetch]] = defaultdict(list)
        for p in sorted(plan, key=lambda p: -p.lead):
            self.plan[p.at].append(p)
        read_tier = manager.tiers[trace.meta.read_tier or manager.memory_tiers[0]]
        self.guess_limit = max(1, read_tier.pool.capacity // 2)   # a sparse reader's gather group
        self.data = torch.zeros(trace.meta.block_bytes, dtype=torch.uint8)   # what every put stores
        self.lease: Lease | None = None
        self.steps = 0

    async def run(self) -> tuple[np.ndarray, float]:
        """Play every op; returns (seconds blocked per op, virtual end of the last op)."""
        loop = asyncio.get_running_loop()
        compute = compute_gaps(self.trace) * self.scale
        blocked = np.zeros(self.trace.n_ops)
        end = 0.0
        for op in self.trace.ops():
            self._enter_step(op.step)
            begin = end + compute[op.index]
            for p in self.plan.get(op.index, ()):
                await _sleep_until(loop, max(end, begin - p.lead * self.scale[op.index]))
                self._prefetch(p)
                # One step of the prefetch's task runs before the next call, as in the engine, where
                # its callback precedes the acquire; the moves it spawns run after the acquire pinned.
                await asyncio.sleep(0)
            await _sleep_until(loop, begin)
            if op.kind is OpKind.GUESS:
                self.seen.on_guess(self._keys(op.index), op.layer, op.source)
                end = loop.time()
                continue
            self._release()
            begin = loop.time()
            await self._call(op)
            end = loop.time()
            blocked[op.index] = end - begin
        self._release()
        self._enter_step(self.trace.n_steps - 1)
        return blocked, end

    async def _call(self, op: Op) -> None:
        if op.kind is OpKind.PUT:
            await self.manager.put(self.keys[int(op.blocks[0])], self.data, layer=op.layer,
                                   persist=self.trace.meta.persist)
        else:
            self.lease = await self.manager.acquire(self._keys(op.index), self.trace.meta.read_tier, layer=op.layer)

    def _prefetch(self, p: Prefetch) -> None:
        keys = self._keys(p.target) if p.blocks is None else [self.keys[i] for i in p.blocks]
        if p.guess and len(keys) > self.guess_limit:
            return   # a sparse reader does not prefetch more than one gather group
        self._release()
        self.manager.prefetch(keys, self.trace.meta.read_tier, layer=self._layer(p.target), guess=p.guess)

    def _enter_step(self, step: int) -> None:
        while self.steps <= step:
            self.seen.begin_step(STEP_KINDS[int(self.trace.step_kind[self.steps])],
                                 int(self.trace.step_tokens[self.steps]))
            self.steps += 1

    def _keys(self, op: int) -> list[BlockKey]:
        return [self.keys[i] for i in self.trace.block[self.start[op]:self.start[op + 1]].tolist()]

    def _layer(self, op: int) -> int | None:
        layer = int(self.trace.op_layer[op])
        return None if layer < 0 else layer

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Wait in virtual time; no yield at all when ``when`` is now (a yield lets queued moves run first)."""
    if when > loop.time():
        await asyncio.sleep(when - loop.time())
