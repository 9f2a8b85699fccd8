"""The policy search: a linear program per batch shape, and an outer loop over batch shapes.

For each candidate (gpu batch size, number of GPU batches, KV compression on/off) the cost
model's terms (`tierkv.schedule.cost`) are linear in the fractions, so the best placement is an
LP (solved with scipy's HiGHS)::

    variables   wg wc wd cg cc cd  t_pre t_dec               (fractions in [0, 1], times >= 0)
    minimize    L * t_pre + L * (n - 1) * t_dec
    subject to  t_phase >= bound(x)        for every lower bound of the phase's layer time
                memory_tier(x) <= budget   for gpu, cpu, disk
                wg + wc + wd = 1,  cg + cc + cd = 1
                wd = cd = 0                when there is no disk tier

    then, among the placements within ``TIE`` of that block time, a second LP minimizes the
    shares left on disk (wd + cd) and then on cpu: where the time does not depend on a
    fraction (a compute-bound shape hides the disk reads) the first LP's vertex is arbitrary,
    and a tie broken towards disk costs time the model does not see (reads compete for the
    cores and the page cache) and wears the disk for nothing.

The outer loop keeps the candidate with the highest predicted throughput. With ``place`` (the
engine's rounding to whole tensors and whole KV blocks, `tierkv.schedule.job.placed_policy`) each
candidate is judged as it will run: its placed fractions are priced and must fit the budgets,
so the search never returns a policy whose placed form the model ranks below another candidate.
The candidates do not depend on the budgets and a larger budget only widens each LP's feasible set, so more memory
never predicts a lower throughput.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from tierkv.errors import ConfigError
from tierkv.schedule.cost import FRACTIONS, Budgets, Estimate, Machine, ModelShape, Terms, Workload, \
    evaluate, fractions, placement_of, terms
from tierkv.schedule.policy import Policy, check_weight_dtype
from tierkv.sizes import format_size

MAX_GPU_BATCH = 256
MAX_GPU_BATCHES = 64
TIE = 1e-6          # relative block time within which placements count as equally fast


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
           max_gpu_batch: int = MAX_GPU_BATCH, place: Callable[[Policy], Policy] | None = None,
           weight_dtype: str | None = None) -> Choice:
    """The policy with the highest predicted throughput that fits ``budgets`` (placed by ``place``),
    its streamed weights kept in ``weight_dtype`` (None: the compute dtype)."""
    check_weight_dtype(weight_dtype)
    best: Choice | None = None
    for bs, nb in candidates(work.num_sequences, max_gpu_batch):
        for compress in (False, True) if allow_compress else (False,):
            t = terms(shape, work, machine, bs, nb, compress=compress, overlap=overlap, weight_dtype=weight_dtype)
            found = _placed_optimum(t, budgets, place)
            if found is None:
                continue
            policy, estimate = found
            if best is None or estimate.tokens_per_s > best.estimate.tokens_per_s * (1 + 1e-9):
                best = Choice(policy, estimate)
    if best is None:
        disk = "or give --nvme-dir" if not budgets.disk else "or raise --nvme-budget"
        raise ConfigError(f"no policy fits the budgets gpu {format_size(budgets.gpu)}, cpu {format_size(budgets.cpu)}, "
                          f"disk {format_size(budgets.disk)}: even one sequence at a time needs more; raise "
                          f"--gpu-budget or --cpu-budget, {disk}")
    return best


def _placed_optimum(t: Terms, budgets: Budgets, place: Callable[[Policy], Policy] | None,
                    tries: int = 4) -> tuple[Policy, Estimate] | None:
    """The LP's policy for ``t``, placed; when rounding pushes a tier over its budget, solve again
    with that tier's budget cut by the overshoot (a few tries), so a slower tier takes the rest."""
    limits = budgets
    for _ in range(tries):
        x = solve(t, limits)
        if x is None:
            return None
        policy = Policy(t.bs, t.nb, weights=placement_of(x, "w"), kv=placement_of(x, "c"),
                        overlap=t.overlap, compress_kv=t.compress, weight_dtype=t.weight_dtype)
        policy = place(policy) if place is not None else policy
        estimate = evaluate(t, fractions(policy))
        if _fits(estimate, budgets):
            return policy, estimate
        over = {tier: max(0.0, estimate.memory[tier] - getattr(budgets, tier)) for tier in ("gpu", "cpu", "disk")}
        limits = Budgets(*(max(0, int(getattr(limits, tier) - over[tier])) for tier in ("gpu", "cpu", "disk")))
    return None


def _fits(estimate: Estimate, budgets: Budgets) -> bool:
    """Within the budgets, up to the LP's own rounding (a few bytes per GiB)."""
    return all(estimate.memory[t] <= getattr(budgets, t) * (1 + 1e-7) + 1 for t in ("gpu", "cpu", "disk"))


def solve(t: Terms, budgets: Budgets) -> dict[str, float] | None:
    """The LP of one batch shape: the fractions minimizing block time, or None when nothing fits.

    Ties in time go to the faster tiers (a second LP, see the module docstring).
    """
    lp = _constraints(t, budgets)
    first = _linprog(lp, lp.time_cost)
    if first is None:
        return None
    best = float(lp.time_cost @ first)
    tie = _Program(np.vstack([lp.a_ub, lp.time_cost]), np.append(lp.b_ub, best * (1 + TIE) + 1e-12),
                   lp.bounds, lp.time_cost)
    second = _linprog(tie, _memory_cost(t))
    x = first if second is None else second
    return {name: float(x[i]) for i, name in enumerate(FRACTIONS)}


@dataclass(frozen=True, slots=True)
class _Program:
    a_ub: np.ndarray
    b_ub: np.ndarray
    bounds: list[tuple[float, float | None]]
    time_cost: np.ndarray          # block time: L * t_pre + L * (n - 1) * t_dec


def _constraints(t: Terms, budgets: Budgets) -> _Program:
    """Variables ``FRACTIONS + (t_pre, t_dec)``; rows scaled to a max coefficient of 1."""
    n = len(FRACTIONS) + 2
    index = {name: i for i, name in enumerate(FRACTIONS)}
    rows, rhs = [], []
    for p, phase in enumerate(("prefill", "decode")):
        for lin in t.phases[phase] if t.overlap else [t.serial[phase]]:
            row = _row(lin.coef, index, n)
            row[len(FRACTIONS) + p] = -1.0
            rows.append(row)
            rhs.append(-lin.const)
    for tier, lin in t.memory.items():
        rows.append(_row(lin.coef, index, n))
        rhs.append(getattr(budgets, tier) - lin.const)
    a, b = np.array(rows), np.array(rhs)
    scale = np.abs(a).max(axis=1, initial=1.0)
    scale[scale == 0] = 1.0
    no_disk = budgets.disk <= 0
    bounds = [(0.0, 0.0) if no_disk and name in ("wd", "cd") else (0.0, 1.0) for name in FRACTIONS]
    cost = np.zeros(n)
    cost[len(FRACTIONS)] = t.layers
    cost[len(FRACTIONS) + 1] = t.layers * max(t.gen_len - 1, 0)
    return _Program(a / scale[:, None], b / scale, bounds + [(0.0, None)] * 2, cost)


def _row(coef: dict[str, float], index: dict[str, int], n: int) -> np.ndarray:
    row = np.zeros(n)
    for name, value in coef.items():
        row[index[name]] = value
    return row


def _memory_cost(t: Terms) -> np.ndarray:
    """Shares on disk first, then shares on cpu (a thousandth as much)."""
    cost = np.zeros(len(FRACTIONS) + 2)
    for name, weight in (("wd", 1.0), ("cd", 1.0), ("wc", 1e-3), ("cc", 1e-3)):
        cost[FRACTIONS.index(name)] = weight
    return cost


def _linprog(lp: _Program, cost: np.ndarray) -> np.ndarray | None:
    eq = np.zeros((2, len(cost)))
    eq[0, 0:3] = 1.0
    eq[1, 3:6] = 1.0
    result = linprog(cost, A_ub=lp.a_ub, b_ub=lp.b_ub, A_eq=eq, b_eq=np.ones(2), bounds=lp.bounds,
                     method="highs")
    return result.x if result.status == 0 else None
