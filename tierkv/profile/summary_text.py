"""The profile summary as text: headline, stall tables, link table, modelled pool, reads."""
from __future__ import annotations

from tierkv.profile.summary import Link, Modelled, Summary
from tierkv.sizes import format_size


def format_summary(s: Summary, title: str = "", top: int = 5) -> str:
    lines = [f"{title}{': ' if title else ''}{s.phase} phase {s.phase_s:.2f} s; {s.steps} decode steps"]
    if s.step_ms:
        m = s.step_ms
        lines.append(f"step latency  p50 {m['p50']:.1f} ms  p90 {m['p90']:.1f} ms  p99 {m['p99']:.1f} ms"
                     f"  (mean {m['mean']:.1f}, max {m['max']:.1f})")
    if s.prefill_s:
        lines.append(f"prefill       {s.prefill_s:.2f} s")
    if s.tiers:
        lines.append("tiers         " + ", ".join(f"{name} {_tier_size(t)}" for name, t in s.tiers.items()))
    lines.append(f"stall         {s.stall_s:.3f} s = {100 * s.stall_fraction:.1f} % of {s.phase_time}, "
                 f"{s.waits} waits")
    lines += _stall_tables(s, top) + _link_table(s.links) + _modelled_table(s.modelled) + _read_lines(s)
    lines += [f"note: {n}" for n in s.notes]
    return "\n".join(lines)


def _tier_size(tier: object) -> str:
    sizes = {k: v for k, v in tier.items() if isinstance(v, (int, float))} if isinstance(tier, dict) else {}
    if "budget_bytes" not in sizes:
        return "?"
    peak = f" (peak {format_size(sizes['peak_bytes'])})" if "peak_bytes" in sizes else ""
    return format_size(sizes["budget_bytes"]) + peak


def _stall_tables(s: Summary, top: int) -> list[str]:
    if not s.waits:
        return []
    shown_links = [r for r in s.by_link if r.of_stall >= 0.001]
    lines = ["", f"{'stall by tier link':22s} {'stall s':>8s} {'of stall':>9s} {'of time':>8s} {'waits':>6s}"]
    lines += [f"  {r.key:20s} {r.seconds:8.3f} {100 * r.of_stall:8.1f}% {100 * r.of_time:7.1f}% {r.waits:6d}"
              for r in shown_links]
    if len(shown_links) < len(s.by_link):
        lines.append(f"  ({len(s.by_link) - len(shown_links)} more under 0.1 % of stall)")
    shown = s.by_layer[:8]
    lines += ["", f"{'stall by layer':22s} {'stall s':>8s} {'of stall':>9s} {'of layer':>8s} {'waits':>6s}"
              + (f"   (top {len(shown)} of {len(s.by_layer)})" if len(shown) < len(s.by_layer) else "")]
    lines += [f"  {'layer ' + r.key:20s} {r.seconds:8.3f} {100 * r.of_stall:8.1f}% {100 * r.of_time:7.1f}% "
              f"{r.waits:6d}" for r in shown]
    lines += ["", "top stall causes"] + [f"  {i}. {c.describe()}" for i, c in enumerate(s.causes[:top], 1)]
    return lines


def _link_table(links: list[Link]) -> list[str]:
    if not links:
        return []
    lines = ["", f"{'link':14s} {'kinds':22s} {'moved':>10s} {'xfers':>6s} {'busy s':>7s} {'GB/s':>7s} "
                 f"{'limit':>7s} {'of limit':>8s}"]
    for r in links:
        limit = f"{r.limit_gbps:7.2f} {100 * r.gbps / r.limit_gbps:7.0f}%" if r.limit_gbps else \
            f"{'?':>7s} {'':>8s}"
        lines.append(f"  {r.link:12s} {r.kinds:22s} {format_size(r.nbytes):>10s} {r.transfers:6d} "
                     f"{r.busy_s:7.3f} {r.gbps:7.2f} {limit}")
    return lines


def _modelled_table(rows: list[Modelled]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"{'CXL pool (modelled)':28s} {'count':>6s} {'bytes':>10s} {'sum s':>8s} {'busy s':>8s} "
                 f"{'of time':>8s}"]
    for r in rows:
        what = f"{r.kind} {r.where}" if r.kind != "compute" else f"near-memory compute {r.where}"
        lines.append(f"  {what:26s} {r.count:6d} {format_size(r.nbytes):>10s} {r.seconds:8.3f} {r.busy_s:8.3f} "
                     f"{100 * r.of_phase:7.1f}%")
    return lines


def _read_lines(s: Summary) -> list[str]:
    if not s.reads:
        return []
    total = sum(r.blocks for r in s.reads)
    lines = ["", f"reads: {total} blocks acquired"]
    lines += [f"  {r.source:32s} {r.blocks:8d} {100 * r.share:6.1f}%" for r in s.reads]
    if s.reuse is not None:
        lines.append(f"cross-step reuse {100 * s.reuse:.1f} % of reads needed no block from storage "
                     "(1 - blocks brought in from nvme, loads and prefetches, / blocks acquired; a lower bound: "
                     "a prefetched block no step read counts)")
    return lines
