"""The policy search: a linear program per batch shape, and an outer loop over batch shapes.

For each candidate (gpu batch size, number of GPU batches, KV compression on/off) the cost
model's terms (`tierkv.schedule.cost`) are linear in the fractions, so the best placement is an
LP (solved with scipy's HiGHS)::

    variables   wg wc wd cg cc cd  t_pre t_dec               (fractions in [0, 1], times >= 0)
    minimize    L * t_pre + L * (n - 1) * t_dec   (+ 1e-9 * (wd + cd): ties go to memory)
    subject to  t_phase >= bound(x)        for every lower bound of the phase's layer time
                memory_tier(x) <= budget   for gpu, cpu, disk
                wg + wc + wd = 1,  cg + cc + cd = 1
                wd = cd = 0                when there is no disk tier

The outer loop keeps the candidate with the highest predicted throughput. The candidates do not
depend on the budgets and a larger budget only widens each LP's feasible set, so more memory
never predicts a lower throughput.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from tierkv.errors import ConfigError
from tierkv.schedule.cost import FRACTIONS, Budgets, Estimate, Machine, ModelShape, Terms, Workload, \
    evaluate, placement_of, terms
from tierkv.schedule.policy import Policy

MAX_GPU_BATCH = 256
MAX_GPU_BATCHES = 64


@dataclass(frozen=True, slots=True)
class Choice:
    policy: Policy
    estimate: Estimate


def candidates(num_sequences: int, max_gpu_batch: int = MAX_GPU_BATCH) -> list[tuple[int, int]]:
    """(gpu batch size, GPU batches) pairs: powers of two (and the whole set) with bs * nb <= sequences."""
    sizes = sorted({2**i for i in range(12) if 2**i <= min(num_sequences, max_gpu_batch)}
                   | ({num_sequences} if num_sequences <= max_gpu_batch else set()))
    pairs = []
    for bs in sizes:
        for nb in (2**i for i in range(7)):
            if nb <= MAX_GPU_BATCHES and bs * nb <= max(num_sequences, bs):
                pairs.append((bs, nb))
    return pairs


def search(shape: ModelShape, work: Workload, machine: Machine, budgets: Budgets, *,
           allow_compress: bool = False, overlap: bool = True,
           max_gpu_batch: int = MAX_GPU_BATCH) -> Choice:
    """The policy with the highest predicted throughput that fits ``budgets``."""
    best: Choice | None = None
    for bs, nb in candidates(work.num_sequences, max_gpu_batch):
        for compress in (False, True) if allow_compress else (False,):
            t = terms(shape, work, machine, bs, nb, compress=compress, overlap=overlap)
            x = solve(t, budgets)
            if x is None:
                continue
            estimate = evaluate(t, x)
            if best is None or estimate.tokens_per_s > best.estimate.tokens_per_s * (1 + 1e-9):
                policy = Policy(bs, nb, weights=placement_of(x, "w"), kv=placement_of(x, "c"),
                                overlap=overlap, compress_kv=compress)
                best = Choice(policy, estimate)
    if best is None:
        raise ConfigError(f"no policy fits the budgets gpu={budgets.gpu} cpu={budgets.cpu} disk={budgets.disk} "
                          "bytes: even one sequence at a time needs more; raise --gpu-budget or --cpu-budget, "
                          "or give --nvme-dir")
    return best


def solve(t: Terms, budgets: Budgets) -> dict[str, float] | None:
    """The LP of one batch shape: the fractions minimizing block time, or None when nothing fits."""
    n = len(FRACTIONS) + 2
    index = {name: i for i, name in enumerate(FRACTIONS)}
    rows, rhs = [], []
    for p, phase in enumerate(("prefill", "decode")):
        bounds = t.phases[phase] if t.overlap else [t.serial[phase]]
        for lin in bounds:
            row = np.zeros(n)
            for name, value in lin.coef.items():
                row[index[name]] = value
            row[len(FRACTIONS) + p] = -1.0
            rows.append(row)
            rhs.append(-lin.const)
    for tier, lin in t.memory.items():
        row = np.zeros(n)
        for name, value in lin.coef.items():
            row[index[name]] = value
        rows.append(row)
        rhs.append(getattr(budgets, tier) - lin.const)
    eq = np.zeros((2, n))
    eq[0, 0:3] = 1.0
    eq[1, 3:6] = 1.0
    no_disk = budgets.disk <= 0
    bounds = [(0.0, 0.0) if no_disk and name in ("wd", "cd") else (0.0, 1.0) for name in FRACTIONS]
    cost = np.zeros(n)
    cost[index["wd"]] = cost[index["cd"]] = 1e-9    # ties go to memory rather than disk
    cost[len(FRACTIONS)] = t.layers
    cost[len(FRACTIONS) + 1] = t.layers * max(t.gen_len - 1, 0)
    scale = np.abs(np.array(rows)).max(axis=1, initial=1.0)
    scale[scale == 0] = 1.0
    result = linprog(cost, A_ub=np.array(rows) / scale[:, None], b_ub=np.array(rhs) / scale,
                     A_eq=eq, b_eq=np.ones(2), bounds=bounds + [(0.0, None)] * 2, method="highs")
    if result.status != 0:
        return None
    return {name: float(result.x[i]) for name, i in index.items()}
