"""Does scoring near the memory of a CXL pool pay, and from which sparse budget on does it stop paying?

For contexts of 32K-1M tokens and sparse budgets of 0.5-5 %, the bytes that
cross the link and the modelled decode-step time (tierkv.tiers.cxl_cost) of::

    pool-host    (a) KV and landmarks in the pool, scored on the host: landmarks + values cross
    pool-near    (b) the same pool, scored by its near-memory processor: query + ids + values cross
    local        (c) everything in local DRAM
    nvme         (d) values on NVMe (4 KiB pages), landmarks in local DRAM
    pool-values  values in the pool, landmarks kept in local DRAM (the host scores)

and where (a) and (b) break even: in budget (per link and processor preset),
in context, and in the processor's scan bandwidth.

The model is checked against the real thing in the same run: a CxlTier
gather (achieved vs modelled GB/s, next to this machine's memcpy), and one
decode step of selection per layer at 32K (128K without --quick) done both
ways for real -- the host gathering landmarks from a CxlTier and running the
``shadowkv`` selector, and the ``near-memory`` selector -- comparing the ids
(must be identical) and the bytes each booked on its link with the model's.

    .venv/bin/python bench/cxl.py --quick --out bench/out/cxl.json --plot bench/out/cxl.png
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI: spinning OpenMP threads on a loaded 2-core host
from dataclasses import dataclass, replace
from pathlib import Path

import torch  # noqa: E402  (after the OpenMP setting)

from policies.selectors import make_selector
from report import Help, Report, machine, out_file, print_grid
from tierkv.profile.probe import FULL as PROBE_FULL, QUICK as PROBE_QUICK, memcpy_link
from tierkv.tiers.cxl import CxlTier
from tierkv.tiers.cxl_cost import (CONFIGS, GEOMETRIES, SERVER, Geometry, Layer, break_even_budget,
                                   break_even_context, break_even_scan_gbps, step_costs)
from tierkv.tiers.cxl_link import LINK_PRESETS, Direction, LinkSpec
from tierkv.tiers.cxl_pnm import PNM_PRESETS

K, MiB = 1024, 1024**2
QUICK = {"contexts": (32 * K, 128 * K, 1024 * K), "budgets": (0.005, 0.01, 0.02, 0.05), "measure": (32 * K,)}
FULL = {"contexts": (32 * K, 64 * K, 128 * K, 256 * K, 512 * K, 1024 * K),
        "budgets": (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05), "measure": (32 * K, 128 * K)}
HEADLINE_BUDGET = 0.02


@dataclass(frozen=True, slots=True)
class Setup:
    geometry: str
    link: str
    pnm: str

    @property
    def g(self) -> Geometry:
        return GEOMETRIES[self.geometry]


def ctx_name(tokens: int) -> str:
    return f"{tokens // (1024 * 1024)}M" if tokens >= 1024 * 1024 else f"{tokens // 1024}K"


# -- the model -----------------------------------------------------------------------------
def model_rows(report: Report, s: Setup, plan: dict) -> None:
    link, pnm = LINK_PRESETS[s.link], PNM_PRESETS[s.pnm]
    for ctx in plan["contexts"]:
        for budget in plan["budgets"]:
            for cost in step_costs(s.g, ctx, budget, link, pnm).values():
                common = dict(context=ctx, budget=budget, source="model")
                report.add_row(cost.config, "link_bytes_per_step", cost.link_bytes, "B", **common)
                report.add_row(cost.config, "step_ms", cost.seconds * 1e3, "ms", **common)


def model_ratios(report: Report, s: Setup, plan: dict) -> None:
    link, pnm = LINK_PRESETS[s.link], PNM_PRESETS[s.pnm]
    for ctx in plan["contexts"]:
        c = step_costs(s.g, ctx, HEADLINE_BUDGET, link, pnm)
        saved = 1 - c["pool-near"].link_bytes / c["pool-host"].link_bytes
        report.add_ratio(f"near_memory_bytes_saved@{ctx_name(ctx)}", round(saved, 4), None,
                         f"1 - link bytes per step of (b) / (a), budget {HEADLINE_BUDGET:.0%}, same model")
        report.add_ratio(f"near_memory_speedup@{ctx_name(ctx)}",
                         round(c["pool-host"].seconds / c["pool-near"].seconds, 3), None,
                         "modelled step time of (a) / (b)")
    top = max(plan["contexts"])
    headline = break_even_budget(s.g, top, link, pnm)
    report.add_ratio("break_even_budget", headline, None,
                     f"smallest budget at which (a) is no slower than (b) at {ctx_name(top)}, {s.link} + {s.pnm}; "
                     "null: (b) is faster at every budget up to 100 %; 0.0001: (a) is faster at every budget")
    for ln in LINK_PRESETS:
        for pn in PNM_PRESETS:
            value = break_even_budget(s.g, top, LINK_PRESETS[ln], PNM_PRESETS[pn])
            report.add_ratio(f"break_even_budget@{ln}+{pn}", value, None, f"the same at {ctx_name(top)}")
    report.add_ratio("break_even_context", break_even_context(s.g, HEADLINE_BUDGET, link, pnm), None,
                     f"smallest context (power of two) from which (b) beats (a), budget {HEADLINE_BUDGET:.0%}")
    gbps = break_even_scan_gbps(s.g, top, HEADLINE_BUDGET, link, pnm)
    report.add_ratio("break_even_pnm_scan_gbps", None if gbps is None else round(gbps, 1), None,
                     f"near-memory scan bandwidth at which (a) = (b), {ctx_name(top)}, {HEADLINE_BUDGET:.0%}; "
                     f"{s.link} reads at {link.read_gbps * link.devices:g} GB/s")


# -- measured in this run ----------------------------------------------------------------
def measure_link(report: Report, quick: bool) -> None:
    """A CxlTier gather at the preset and at a tenth of it, against the model and this host's memcpy."""
    nbytes = (64 if quick else 256) * MiB
    memcpy = memcpy_link(PROBE_QUICK if quick else PROBE_FULL)["gbps"]
    report.add_row("memcpy", "gbps", memcpy, "GB/s", source="measured")
    preset = LINK_PRESETS["cxl2-x8"]
    for name, spec in (("cxl2-x8", preset), ("cxl2-x8/10", LinkSpec(preset.read_gbps / 10, preset.write_gbps / 10,
                                                                     preset.latency_ns))):
        block = 4 * MiB
        tier = CxlTier(block, nbytes, spec)
        slots = list(range(nbytes // block))
        for s in slots:
            tier.view(s).fill_(s % 251)
        out = torch.empty(nbytes, dtype=torch.uint8)
        best = min(_timed(lambda: tier.gather(slots, out)) for _ in range(3))
        modelled = spec.seconds(nbytes, Direction.READ)
        report.add_row(f"cxl-gather {name}", "gbps", nbytes / best / 1e9, "GB/s", source="measured",
                       modelled_gbps=nbytes / modelled / 1e9, vs_model=modelled / best)
        tier.close()


def measure_selection(report: Report, s: Setup, ctx: int, steps: int) -> None:
    """One decode step's selection per layer, both ways for real: ids and link bytes against the model."""
    g, budget = replace(s.g, itemsize=4), HEADLINE_BUDGET   # float32: bf16 matmuls crawl on this CPU
    layer = Layer.of(g, ctx, budget)
    chunks, k = -(-ctx // g.chunk_tokens), max(1, math.ceil(budget * -(-ctx // g.chunk_tokens)))
    gen = torch.Generator().manual_seed(ctx)
    dtype = torch.float32
    landmarks = [torch.randn(chunks, g.kv_heads, g.head_dim, generator=gen).to(dtype) for _ in range(g.layers)]
    candidates = torch.ones(chunks, dtype=torch.bool)
    pool = _landmark_pool(landmarks, s.link)
    host, near = make_selector("shadowkv"), make_selector("near-memory", link=s.link, pnm=s.pnm)
    for i, lm in enumerate(landmarks):   # prefill: the pool processor gets each layer's landmarks once
        near.processor.store(i, lm, candidates)
    near.processor.reset_stats()
    pool.link.reset_stats()
    same, host_s, near_s = 0, 0.0, 0.0
    for _ in range(steps):
        queries = [torch.randn(g.q_heads, g.head_dim, generator=gen).to(dtype) for _ in range(g.layers)]
        for i, q in enumerate(queries):
            t0 = time.perf_counter()
            view = _View(i, pool.read_layer(i), candidates)
            a = host.select(q, view, k)
            t1 = time.perf_counter()
            b = near.select(q, view, k)
            near_s += time.perf_counter() - t1
            host_s += t1 - t0
            same += int(torch.equal(a, b))
    name = ctx_name(ctx)
    measured_a = pool.link.stats.total_bytes / steps
    measured_b = near.processor.link.stats.total_bytes / steps
    report.add_row("pool-host selection", "link_bytes_per_step", measured_a, "B", context=ctx, budget=budget,
                   source="measured", model=layer.landmarks * g.layers)
    report.add_row("pool-near selection", "link_bytes_per_step", measured_b, "B", context=ctx, budget=budget,
                   source="measured", model=(layer.query + layer.ids) * g.layers)
    report.add_row("pool-host selection", "step_ms", host_s / steps * 1e3, "ms", context=ctx, source="measured")
    report.add_row("pool-near selection", "step_ms", near_s / steps * 1e3, "ms", context=ctx, source="measured",
                   modelled_compute_ms=near.processor.stats.compute_s / steps * 1e3,
                   host_overrun_ms=near.processor.stats.overrun_s / steps * 1e3)
    report.add_ratio(f"same_chunks@{name}", same / (steps * g.layers), 1.0,
                     "share of (layer, step) selections where near-memory ids == host-side ids")
    report.add_ratio(f"selection_bytes_vs_model@{name}", round(measured_b / ((layer.query + layer.ids) * g.layers), 4),
                     None, "near-memory link bytes booked by the real selector / the model's query + ids bytes")
    report.add_ratio(f"host_scan_bytes_vs_model@{name}", round(measured_a / (layer.landmarks * g.layers), 4), None,
                     "landmark bytes the host really gathered from a CxlTier / the model's landmark bytes")


@dataclass
class _View:
    layer: int
    landmarks: torch.Tensor
    candidates: torch.Tensor
    lo: None = None
    hi: None = None
    landmark_scale: None = None    # (float landmarks: no int8 scale)


class _LandmarkPool:
    """Every layer's landmarks in a CxlTier, read back (over the link) for host-side scoring."""

    def __init__(self, landmarks: list[torch.Tensor], link: str) -> None:
        self.shape, self.dtype = landmarks[0].shape, landmarks[0].dtype
        self.block = -(-landmarks[0].nbytes // 4096) * 4096
        self.tier = CxlTier(self.block, self.block * len(landmarks), link)
        self.link = self.tier.link
        for i, lm in enumerate(landmarks):
            self.tier.view(i)[:lm.nbytes].copy_(lm.contiguous().view(-1).view(torch.uint8))

    def read_layer(self, layer: int) -> torch.Tensor:
        out = torch.empty(self.block, dtype=torch.uint8)
        self.tier.gather([layer], out)
        n = math.prod(self.shape) * torch.finfo(self.dtype).bits // 8
        return out[:n].view(self.dtype).view(self.shape)


def _landmark_pool(landmarks: list[torch.Tensor], link: str) -> _LandmarkPool:
    return _LandmarkPool(landmarks, link)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- plots -------------------------------------------------------------------------------
def plot(report: Report, s: Setup, plan: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    rows = [r for r in report.rows if r.get("source") == "model"]
    fig = Figure(figsize=(13, 9.5), layout="constrained")
    axes = fig.subplots(2, 2)
    colors = dict(zip(CONFIGS, ("tab:red", "tab:green", "tab:blue", "tab:gray", "tab:orange")))
    for ax, metric, title in ((axes[0][0], "link_bytes_per_step", "bytes across the link per decode step"),
                              (axes[0][1], "step_ms", "modelled decode-step time")):
        for config in CONFIGS:
            pts = sorted((r["context"], r["value"]) for r in rows
                         if r["config"] == config and r["metric"] == metric and r["budget"] == HEADLINE_BUDGET)
            if config == "local" and metric == "link_bytes_per_step":
                continue   # nothing crosses a link
            ax.plot([p[0] for p in pts], [p[1] / (MiB if "bytes" in metric else 1) for p in pts], "o-",
                    color=colors[config], label=config)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", title=f"{title}, budget {HEADLINE_BUDGET:.0%}",
               ylabel="MiB" if "bytes" in metric else "ms")
        ax.legend()
    top = max(plan["contexts"])
    ax = axes[1][0]
    for config in CONFIGS:
        pts = sorted((r["budget"], r["value"]) for r in rows
                     if r["config"] == config and r["metric"] == "step_ms" and r["context"] == top)
        ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[config], label=config)
    ax.set(xlabel="sparse budget (% of context)", ylabel="ms", yscale="log",
           title=f"modelled step time vs budget at {ctx_name(top)}")
    ax.legend()
    _plot_break_even(axes[1][1], s, top)
    fig.suptitle(f"CXL pool, {s.geometry}: link {s.link}, near-memory {s.pnm} (model; see bench/cxl.py)")
    FigureCanvasAgg(fig).print_png(str(path))


def _plot_break_even(ax, s: Setup, ctx: int) -> None:
    budgets = [10 ** (-3 + 3 * i / 60) for i in range(61)]
    for ln, style in (("cxl2-x8", "-"), ("cxl2-x16", "--")):
        for pn, color in (("pnm-ocp25", "tab:green"), ("pnm-expander", "tab:purple")):
            ratio = [step_costs(s.g, ctx, b, LINK_PRESETS[ln], PNM_PRESETS[pn])["pool-host"].seconds
                     / step_costs(s.g, ctx, b, LINK_PRESETS[ln], PNM_PRESETS[pn])["pool-near"].seconds for b in budgets]
            ax.plot([100 * b for b in budgets], ratio, style, color=color, label=f"{ln} + {pn}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axvspan(0.5, 5, color="tab:blue", alpha=0.08, label="budgets 0.5-5 %")
    ax.set(xscale="log", xlabel="sparse budget (% of context)", ylabel="(a) / (b) step time",
           title=f"near-memory speed-up at {ctx_name(ctx)}: below 1, host scoring wins")
    ax.legend(fontsize=8)


# -- main --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=Help)
    parser.add_argument("--quick", action="store_true", help="3 contexts, 4 budgets, measure at 32K (~1 min)")
    parser.add_argument("--out", type=out_file, help="write the result as JSON (format: bench/report.py)")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="draw bytes, step times and break-even")
    parser.add_argument("--geometry", default="smollm2-135m", choices=sorted(GEOMETRIES),
                        help="the model whose KV the pool holds (its layers, KV heads and head size)")
    parser.add_argument("--link", default="cxl2-x8", choices=sorted(LINK_PRESETS), help="the pool's link, as tierkv "
                        "run --cxl-preset names them")
    parser.add_argument("--pnm", default="pnm-ocp25", choices=sorted(PNM_PRESETS),
                        help="the near-memory processor's preset")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    plan, setup = QUICK if args.quick else FULL, Setup(args.geometry, args.link, args.pnm)
    report = Report("cxl", args.quick, machine())
    start = time.perf_counter()
    model_rows(report, setup, plan)
    model_ratios(report, setup, plan)
    measure_link(report, args.quick)
    for ctx in plan["measure"]:
        measure_selection(report, setup, ctx, steps=2 if args.quick else 4)
    report.seconds = round(time.perf_counter() - start, 1)
    add_bounds(report, setup)
    print_model(report)
    measured = Report(report.bench, report.quick, report.machine, [r for r in report.rows if r["source"] != "model"],
                      report.ratios, report.bounds, report.seconds)
    measured.print_table(["config", "metric", "context", "budget", "value", "unit", "model", "modelled_gbps",
                          "vs_model", "modelled_compute_ms", "host_overrun_ms"])
    if args.out:
        report.write_json(args.out)
    if args.plot:
        plot(report, setup, plan, args.plot)
    return report


def print_model(report: Report) -> None:
    """Model rows as one line per (context, budget): MiB across the link and ms per step, per config."""
    cells: dict[tuple[int, float], dict[str, str]] = {}
    for r in report.rows:
        if r["source"] == "model":
            cell = cells.setdefault((r["context"], r["budget"]), {})
            text = f"{r['value'] / MiB:.1f} MiB" if r["metric"] == "link_bytes_per_step" else f"{r['value']:.2f} ms"
            cell[r["config"]] = f"{cell[r['config']]} / {text}" if r["config"] in cell else text
    grid = [[ctx_name(ctx), f"{100 * b:g} %", *(cell.get(c, "-") for c in CONFIGS)] for (ctx, b), cell in cells.items()]
    print("modelled per decode step: bytes across the link / step time")
    print_grid(["context", "budget", *CONFIGS], grid)
    print()


def add_bounds(report: Report, s: Setup) -> None:
    link, pnm = LINK_PRESETS[s.link], PNM_PRESETS[s.pnm]
    report.add_bound(f"model rows: {s.geometry} ({s.g.layers} layers, {s.g.kv_heads} KV heads x {s.g.head_dim}, "
                     f"bf16, chunks of {s.g.chunk_tokens}); link {s.link} ({link.read_gbps:g}/{link.write_gbps:g} GB/s, "
                     f"{link.latency_ns:g} ns, {link.devices} device(s)); processor {s.pnm} ({pnm.scan_gbps:g} GB/s scan, "
                     f"{pnm.tflops:g} TF/s, {pnm.launch_us:g} us a command); host: {SERVER} (assumptions, "
                     "see tierkv/tiers/cxl_cost.py)")
    report.add_bound("(a) and (b) fetch the same selected values, so the budget adds the same bytes to both: "
                     "near-memory scoring saves the landmark scan (1/8 of the keys) and costs its processor's "
                     "time; it stops paying when the processor scans slower than the link streams "
                     "(break_even_pnm_scan_gbps) or its top-k and command overhead exceed the saving")
    report.add_bound("measured rows: this machine's memcpy bounds a CxlTier gather (the model only adds delay); "
                     "the near-memory selector computes its ids on this CPU, whose time beyond the modelled "
                     "processor's is reported as host_overrun_ms, not as link or compute time")


if __name__ == "__main__":
    main()
