"""Does trace replay predict real runs? Bytes moved and stall, replayed vs measured, per eviction policy.

For each policy, a real SmolLM2 run (chunked prefill, then greedy decode; the
KV spilled gpu -> cpu -> NVMe, the policy in the gpu and cpu tiers) records
an access trace and measures bytes moved per link and stall (time acquire
waited). The first policy's trace is then replayed under every policy::

    real run (policy p)                    replay of trace_0 under p            ratio (worst over p)
    bytes moved between tiers              modelled bytes moved                 bytes_prediction_error
    stall: sum of acquire waits            modelled stall                       stall_prediction_error
    policies ranked by bytes, then stall   ranked by the predictions            ranking_agreement

Three tier models price the replays; each is a measurement of this machine:

    run     the machine as it was during run p: its links (each link's bytes over its busy
            time, overlaps once; the store's reads and writes one channel) and its compute time
            over trace_0's per step kind; the access pattern and where the compute falls between
            calls come from trace_0. It checks the simulator, not the machine's drift -> the ratios
    trace   what ``tierkv tune`` does with a trace: the links and compute of trace_0's own run
            price every policy -> the *_fixed_model ratios; a shared machine's drift between
            runs (NVMe throughput moving 1.5-2x within minutes) shows here
    probe   tierkv.profile.probe's raw device numbers, measured idle before the runs

    python bench/replay.py --quick --out bench/out/replay.json
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path

import numpy as np

from report import Help, Report, filesystem, machine, out_file, print_grid
from tierkv.config import TierConfig
from tierkv.sizes import format_size
from tierkv.manager import BlockingTierManager
from tierkv.model.engine import Engine, EngineConfig
from tierkv.model.loading import LoadedModel, load_model
from tierkv.model.prompt import passkey_prompt
from tierkv.layout import BlockLayout
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import STEP_KINDS, AccessTrace
from tierkv.profile.link_stats import link_bytes
from tierkv.events import EventRecorder
from tierkv.tune.replay import ReplayConfig, ReplayResult, compute_gaps, replay
from tierkv.tune.tier_model import TierModel

TARGETS = {"bytes_prediction_error": 0.05, "stall_prediction_error": 0.25, "ranking_agreement": 1.0}
LOWER_IS_BETTER = {"bytes_prediction_error", "stall_prediction_error"}
# Measured (bytes, stall) closer than these (relative) tie: either order agrees. Stall differences smaller
# than the model's own accuracy cannot rank.
TIES = (0.02, TARGETS["stall_prediction_error"])
RAMDISKS = ("tmpfs", "ramfs", "devtmpfs")
HICCUP_S = 0.05     # a wait this long is the machine pausing the run, not the tiers


@dataclass(frozen=True, slots=True)
class Plan:
    tokens: int                 # prompt length
    decode: int                 # decode steps
    gpu_slots: int              # budgets in blocks
    cpu_slots: int
    policies: tuple[str, ...]
    block_tokens: int = 256
    chunk_tokens: int = 1024


QUICK = Plan(tokens=1280, decode=24, gpu_slots=20, cpu_slots=30, policies=("lru", "lfu", "s3fifo"))
FULL = Plan(tokens=4096, decode=64, gpu_slots=48, cpu_slots=96, policies=("lru", "fifo", "lfu", "arc", "s3fifo"))


@dataclass(slots=True)
class Measured:
    policy: str
    trace: AccessTrace
    bytes_by_link: dict[str, int]
    stall_s: float
    decode_stall_s: float
    wall_s: float

    @property
    def moved_bytes(self) -> int:
        return sum(n for link, n in self.bytes_by_link.items() if not link.startswith("new->"))


# -- the real runs ---------------------------------------------------------------------
def real_run(loaded: LoadedModel, policy: str, plan: Plan, ids: list[int], store: Path) -> Measured:
    spec = loaded.spec
    layout = BlockLayout.kv(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, plan.block_tokens)
    bb = layout.block_bytes
    config = TierConfig(block_bytes=bb, gpu=plan.gpu_slots * bb, cpu=plan.cpu_slots * bb, nvme_dir=store,
                        nvme_budget="4GiB", gpu_policy=policy, cpu_policy=policy)
    events = EventRecorder()
    with BlockingTierManager.from_config(config, namespace=layout.name, recorder=events) as manager:
        engine = Engine(loaded, manager, EngineConfig(plan.block_tokens, plan.chunk_tokens, reuse=False))
        seq = engine.new_sequence()
        access = AccessRecorder(read_tier=seq.read_tier, info={"model": loaded.model_id, "policy": policy,
                                                               "prompt_tokens": len(ids)}).attach(manager.manager)
        start = time.perf_counter()
        logits, _ = engine.prefill(seq, ids)
        token = int(logits.argmax())
        for _ in range(plan.decode):
            token = int(engine.decode(seq, token).argmax())
        wall = time.perf_counter() - start
        manager.flush()
        trace = access.trace(manager.manager)
    waits = [e for e in events.events if e.kind == "wait"]
    decode_from = trace.step_time[trace.step_kind == 1].min() + access.origin if plan.decode else math.inf
    return Measured(policy, trace, link_bytes(events.events), sum(e.done - e.start for e in waits),
                    sum(e.done - e.start for e in waits if e.start >= decode_from), wall)


# -- tier models ---------------------------------------------------------------------------------
def compute_speed(run: AccessTrace, recorded: AccessTrace) -> dict[str, float]:
    """Per step kind, run's compute time over the recorded trace's (the machine is shared: it drifts)."""
    def by_kind(trace: AccessTrace) -> np.ndarray:
        return np.bincount(trace.step_kind[trace.op_step], compute_gaps(trace), minlength=len(STEP_KINDS))
    ratio = by_kind(run) / np.maximum(by_kind(recorded), 1e-9)
    return {kind: float(ratio[i]) if ratio[i] > 0 else 1.0 for i, kind in enumerate(STEP_KINDS)}


def probe_model(workdir: Path) -> TierModel | None:
    """tierkv.profile.probe's raw device numbers, measured now (where that module is present)."""
    try:
        from tierkv.profile.probe import measure_links
    except ImportError:
        return None
    return TierModel.from_probe(measure_links(workdir, quick=True))


# -- comparing ----------------------------------------------------------------------------------
def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured if measured else (0.0 if predicted == 0 else math.inf)


Costs = Sequence[tuple[float, float]]  # (bytes moved, stall) per policy


def ranking_agreement(measured: Costs, predicted: Costs) -> tuple[float, int]:
    """Share of policy pairs that both rank alike by (bytes, then stall); pairs tied in the measurement count as alike.

    Returns (agreement, pairs tied).
    """
    agree, ties, pairs = 0, 0, list(combinations(range(len(measured)), 2))
    for a, b in pairs:
        m, p = _order(measured[a], measured[b]), _order(predicted[a], predicted[b])
        ties += m == 0
        agree += m == 0 or m == p
    return (agree / len(pairs) if pairs else 1.0), ties


def _order(x: tuple[float, float], y: tuple[float, float]) -> int:
    """-1 / 1 when x ranks before / after y by bytes (then by stall when bytes tie), 0 when both tie."""
    for u, v, tie in zip(x, y, TIES):
        if abs(u - v) > tie * max(abs(u), abs(v)):
            return -1 if u < v else 1
    return 0


# -- the report ---------------------------------------------------------------------------------
def add_rows(report: Report, model_name: str, runs: list[Measured], predictions: list[ReplayResult]) -> None:
    for run, pred in zip(runs, predictions):
        for metric, measured, predicted, unit in (
                ("moved_bytes", run.moved_bytes, pred.moved_bytes, "B"),
                ("stall_s", run.stall_s, pred.stall_s, "s"),
                ("decode_stall_s", run.decode_stall_s, pred.decode_stall_s, "s")):
            report.add_row(run.policy, metric, measured, unit, model=model_name, predicted=predicted,
                           error=round(relative_error(predicted, measured), 4))
        hits = run.trace.hit_rates(("decode",))
        report.add_row(run.policy, "gpu_hit_rate_decode", round(hits.get("gpu", 0.0), 4), "", model=model_name,
                       predicted=round(pred.trace.hit_rates(("decode",)).get("gpu", 0.0), 4))


def add_ratios(report: Report, runs: list[Measured], predictions: list[ReplayResult], suffix: str = "",
               how: str = "") -> None:
    bytes_err = max(relative_error(p.moved_bytes, r.moved_bytes) for r, p in zip(runs, predictions))
    stall_err = max(relative_error(p.stall_s, r.stall_s) for r, p in zip(runs, predictions))
    agreement, ties = ranking_agreement([(r.moved_bytes, r.stall_s) for r in runs],
                                        [(p.moved_bytes, p.stall_s) for p in predictions])
    report.add_ratio("bytes_prediction_error" + suffix, round(bytes_err, 4), TARGETS["bytes_prediction_error"],
                     "worst |replayed / measured - 1| of bytes moved between tiers over the policies "
                     f"(lower is better: the target is a ceiling){how}", ceiling=True)
    report.add_ratio("stall_prediction_error" + suffix, round(stall_err, 4), TARGETS["stall_prediction_error"],
                     "worst |modelled / measured - 1| of stall (time acquire waited) over the policies "
                     f"(lower is better: the target is a ceiling){how}", ceiling=True)
    report.add_ratio("ranking_agreement" + suffix, round(agreement, 3), TARGETS["ranking_agreement"],
                     f"share of policy pairs ranked alike by (bytes moved, then stall), replayed vs measured; "
                     f"{ties} pair(s) tied in the measurement (bytes within {TIES[0]:.0%}, stall within "
                     f"{TIES[1]:.0%}) count as alike{how}")


def print_report(report: Report) -> None:
    """Rows, then ratios with a verdict that knows which way is better."""
    ratios, report.ratios = report.ratios, []
    report.print_table(["config", "model", "metric", "value", "predicted", "error", "unit"],
                       {"value": _fmt, "predicted": _fmt})
    report.ratios = ratios
    print()
    cells = [[r.name, f"{r.value:.4g}", f"{r.target:.4g}", _verdict(r.name, r.value, r.target), r.meaning]
             for r in ratios]
    print_grid(["ratio", "value", "target", "", "meaning"], cells)


def _verdict(name: str, value: float, target: float) -> str:
    ok = value <= target if name.removesuffix("_fixed_model") in LOWER_IS_BETTER else value >= target
    return "ok" if ok else "MISSED"


def _fmt(value: object) -> str:
    if isinstance(value, int) and value >= 1024:
        return format_size(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# -- command line -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=Help)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.tokens}-token prompt, {QUICK.decode} decode steps, policies "
                             f"{','.join(QUICK.policies)} (~1-2 min on 2 idle cores)")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the NVMe stores go; a real disk, not tmpfs (default: the temp dir)")
    parser.add_argument("--policies", help="comma-separated eviction policies (the first one's trace is replayed)")
    parser.add_argument("--tokens", type=int, help="prompt tokens")
    parser.add_argument("--decode", type=int, help="decode steps")
    parser.add_argument("--save-traces", type=Path, metavar="DIR", help="also write each run's access trace here")
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else FULL
    if args.policies:
        plan = replace(plan, policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()))
    if len(plan.policies) < 2:
        raise SystemExit("--policies: give at least two, so there is a ranking to compare")
    return replace(plan, tokens=args.tokens or plan.tokens, decode=plan.decode if args.decode is None else args.decode)


def make_workdir(base: Path) -> Path:
    fstype, _, mount = filesystem(base)
    if fstype in RAMDISKS:
        raise SystemExit(f"--dir={base} is on {fstype} ({mount}): NVMe numbers would measure RAM")
    return Path(tempfile.mkdtemp(prefix=".tierkv-replay-", dir=base))


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    plan = make_plan(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the stores still go
    workdir = make_workdir(args.dir)
    report = Report("replay", args.quick, machine(workdir))
    started = time.perf_counter()
    try:
        loaded = load_model("smollm2")
        ids = passkey_prompt(loaded.tokenizer, plan.tokens).ids
        raw = probe_model(workdir)
        runs = []
        for policy in plan.policies:
            runs.append(real_run(loaded, policy, plan, ids, workdir / f"store-{policy}"))
            print(f"{policy}: {runs[-1].wall_s:.1f} s, moved {format_size(runs[-1].moved_bytes)}, "
                  f"stall {runs[-1].stall_s:.2f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
        if args.save_traces:
            args.save_traces.mkdir(parents=True, exist_ok=True)
            for run in runs:
                run.trace.write(args.save_traces / f"{run.policy}.trace")
        recorded = runs[0].trace
        models = {"run": [(TierModel.from_trace(r.trace), compute_speed(r.trace, recorded)) for r in runs],
                  "trace": [(TierModel.from_trace(recorded), 1.0)] * len(runs)}
        if raw is not None:
            models["probe"] = [(raw, 1.0)] * len(runs)  # idle numbers, trace_0's compute
        predictions = {name: [replay(recorded, m, ReplayConfig({"gpu": r.policy, "cpu": r.policy}, compute_scale=c))
                              for r, (m, c) in zip(runs, chosen)] for name, chosen in models.items()}
        for name, predicted in predictions.items():
            add_rows(report, name, runs, predicted)
        add_ratios(report, runs, predictions["run"],
                   how="; tier model: links and compute speed as in each policy's own run (drift removed)")
        add_ratios(report, runs, predictions["trace"], "_fixed_model",
                   f"; tier model: the {runs[0].policy} run's own links and compute, for every policy")
        _add_bounds(report, plan, models, runs, recorded, _roundtrip(recorded, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = round(time.perf_counter() - started, 1)
    report.add_bound(f"load: 1-min load average {report.machine['load_avg_1m']} at start, "
                     f"{os.getloadavg()[0]:.2f} at end, on {report.machine['threads']} CPUs")
    if args.out:
        report.write_json(args.out)
    print_report(report)
    return report


def _roundtrip(trace: AccessTrace, workdir: Path) -> bool:
    path = workdir / "roundtrip.trace"
    trace.write(path)
    return AccessTrace.read(path) == trace


Models = dict[str, list[tuple[TierModel, "float | dict[str, float]"]]]  # per policy: (links, compute scale)


def _add_bounds(report: Report, plan: Plan, models: Models, runs: list[Measured], recorded: AccessTrace,
                roundtrip: bool) -> None:
    bb = recorded.meta.block_bytes
    report.add_bound(f"workload: SmolLM2 fp32, {plan.tokens}-token prompt in {plan.chunk_tokens}-token chunks, "
                     f"{plan.decode} decode steps; blocks of {plan.block_tokens} tokens ({format_size(bb)}); "
                     f"gpu {plan.gpu_slots} / cpu {plan.cpu_slots} blocks, the rest on NVMe; prefetch as the engine")
    report.add_bound(f"replayed trace: the {runs[0].policy} run's ({recorded.n_ops} calls, {recorded.n_steps} "
                     f"steps, {recorded.n_blocks} blocks; written and read back identical: {roundtrip})")
    for run in runs:
        waits = run.trace.op_blocked[run.trace.op_kind == 1]
        hiccups = waits[waits > HICCUP_S]
        report.add_bound(f"{run.policy} run: {len(hiccups)} waits over {HICCUP_S * 1e3:.0f} ms made "
                         f"{hiccups.sum():.2f} s of its {waits.sum():.2f} s stall (longest "
                         f"{waits.max(initial=0):.3f} s); such hiccups of a shared machine are in no model")
    for run, (model, speed) in zip(runs, models["run"]):
        nvme = model.links.get("nvme->*")
        report.add_bound(f"{run.policy} run: wall {run.wall_s:.1f} s, compute x{speed['prefill']:.2f} (prefill) "
                         f"x{speed['decode']:.2f} (decode) the replayed trace's; "
                         f"the NVMe channel delivered "
                         f"{nvme.gbps if nvme else float('nan'):.3f} GB/s while busy; memory links "
                         + ", ".join(f"{k} {v.gbps:.2f}" for k, v in model.links.items() if "nvme" not in k)
                         + f" GB/s; {model.overhead_us:.0f} us submit-to-start")
    if "probe" in models:
        report.add_bound("probe (idle, before the runs): " + "; ".join(
            f"{k} {v.gbps:.2f} GB/s, {v.latency_us:.0f} us x ceil(blocks/{v.queue_depth})"
            for k, v in models["probe"][0][0].links.items()))


if __name__ == "__main__":
    main()
