"""One PNG of a profile: a timeline of a few steps, the step-latency CDF, stall by link and by layer.

::

    +-------------------------------------------------------------+
    | timeline: the slowest decode step and its neighbours        |
    |   steps / layers, stalls, then one row per tier-link lane   |
    +--------------------+--------------------+-------------------+
    | step latency CDF   | stall by tier link | stall by layer    |
    +--------------------+--------------------+-------------------+

Drawn with matplotlib's Agg canvas (no display, no pyplot state); matplotlib
is an optional dependency: ``pip install 'tierkv-runtime[profile]'``.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from tierkv.errors import ConfigError
from tierkv.events import Event, EventKind
from tierkv.flags import check_writable
from tierkv.profile.summary import Summary

KIND_COLORS = {"load": "#e6550d", "prefetch": "#3182bd", "demote": "#756bb1", "writeback": "#969696",
               "put": "#31a354", "wait": "#d62728"}
LAYER_SHADES = ("#dadaeb", "#bcbddc")
STALL_KINDS = {"load": "load", "prefetch": "late prefetch", "demote": "demote (room)", "": "unattributed"}
MIN_SHARE = 0.005   # links below this share of the stall are left out of the bar chart


def plot_profile(events: Sequence[Event], summary: Summary, path: Path, *, steps: int = 3) -> None:
    """Render the profile of ``events`` (summarized as ``summary``) to the PNG ``path``."""
    Figure, FigureCanvasAgg = matplotlib_canvas()
    fig = Figure(figsize=(16, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 3, height_ratios=(1.25, 1))
    _timeline(fig.add_subplot(grid[0, :]), events, steps)
    _cdf(fig.add_subplot(grid[1, 0]), events, summary)
    _by_link(fig.add_subplot(grid[1, 1]), summary)
    _by_layer(fig.add_subplot(grid[1, 2]), summary)
    fig.suptitle(f"tierkv profile: {summary.steps} decode steps, stall {100 * summary.stall_fraction:.1f} % "
                 f"of {summary.phase_time}", fontsize=14)
    fig.savefig(path)


def matplotlib_canvas():
    """matplotlib's Figure and Agg canvas; a ConfigError saying how to install it where it is not."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'tierkv-runtime[profile]'") from None
    return Figure, FigureCanvasAgg


def check_plot_path(path: Path, flag: str = "--plot") -> None:
    """That a plot can be saved to ``path``, before the work it shows: a writable file whose suffix
    names a format matplotlib writes."""
    _, canvas = matplotlib_canvas()
    formats = canvas.get_supported_filetypes()
    if Path(path).suffix.lower().removeprefix(".") not in formats:
        raise ConfigError(f"{flag} {path}: give a file name ending in a format matplotlib writes: "
                          f"{', '.join('.' + f for f in sorted(formats))}")
    check_writable(flag, path)


# -- timeline --------------------------------------------------------------
def timeline_window(events: Sequence[Event], steps: int) -> tuple[float, float, str]:
    """(start, end, label) of ``steps`` consecutive decode steps around the slowest one."""
    found = sorted((e for e in events if e.kind == EventKind.STEP), key=lambda e: e.start)
    if not found:
        layers = sorted((e for e in events if e.kind == EventKind.LAYER), key=lambda e: e.start)[:32]
        spans = layers or sorted(events, key=lambda e: e.start)[:200]
        return spans[0].start, max(e.done for e in spans), "the first layers of the run (no decode steps)"
    slowest = max(range(len(found)), key=lambda i: found[i].done - found[i].start)
    first = max(0, min(slowest - steps // 2, len(found) - steps))
    shown = found[first:first + steps]
    return shown[0].start, shown[-1].done, (f"decode steps {first + 1}-{first + len(shown)} of {len(found)} "
                                            f"(step {slowest + 1} is the slowest)")


def _lanes(events: list[Event]) -> dict[str, list[list[Event]]]:
    """Transfers per link, split into lanes whose slices do not overlap (as in the trace file)."""
    lanes: dict[str, list[list[Event]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: e.start):
        rows = lanes[f"{e.src or 'new'}->{e.dst}"]
        row = next((r for r in rows if r[-1].done <= e.start), None)
        if row is None:
            rows.append(row := [])
        row.append(e)
    return lanes


def _timeline(ax, events: Sequence[Event], steps: int) -> None:
    start, end, label = timeline_window(events, steps)
    shown = [e for e in events if e.done > start and e.start < end]
    transfers = [e for e in shown if e.kind in KIND_COLORS and e.kind != EventKind.WAIT]
    rows = ["steps / layers", "stall"]
    for link, lanes in sorted(_lanes(transfers).items()):
        rows += [link if i == 0 else f"{link} #{i + 1}" for i in range(len(lanes))]
        for i, lane in enumerate(lanes):
            _bars(ax, lane, len(rows) - len(lanes) + i, start, lambda e: KIND_COLORS[e.kind])
    _bars(ax, [e for e in shown if e.kind == EventKind.WAIT], 1, start, lambda e: KIND_COLORS["wait"])
    _steps_row(ax, shown, start, _step_numbers(events))
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.4, -0.85)   # room above the steps row for the step labels
    ax.set_xlim(0, (end - start) * 1e3)
    ax.set_xlabel("ms")
    ax.set_title(f"timeline: {label}", loc="left")
    ax.grid(axis="x", alpha=0.3)
    kinds = sorted({e.kind for e in transfers}) + ["wait"]
    handles = [_patch(KIND_COLORS[k], "stall (wait)" if k == "wait" else k) for k in kinds]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1, 1), ncols=len(handles), fontsize=9,
              frameon=False)


def _bars(ax, events: list[Event], row: int, origin: float, color, height: float = 0.7) -> None:
    if events:
        spans = [((e.start - origin) * 1e3, max((e.done - e.start) * 1e3, 0.05)) for e in events]
        ax.broken_barh(spans, (row - height / 2, height), facecolors=[color(e) for e in events],
                       edgecolor="none")


def _step_numbers(events: Sequence[Event]) -> dict[int, int]:
    steps = sorted((e for e in events if e.kind == EventKind.STEP), key=lambda e: e.start)
    return {id(e): i + 1 for i, e in enumerate(steps)}


def _steps_row(ax, shown: list[Event], origin: float, numbers: dict[int, int]) -> None:
    layers = [e for e in shown if e.kind == EventKind.LAYER]
    _bars(ax, layers, 0, origin, lambda e: LAYER_SHADES[(e.layer or 0) % 2], height=0.55)
    for e in layers:
        if e.layer is not None and e.layer % 5 == 0:
            ax.text((e.start - origin) * 1e3, 0, str(e.layer), fontsize=7, va="center", clip_on=True)
    for e in shown:
        if e.kind in (EventKind.STEP, EventKind.PREFILL):
            x = (e.start - origin) * 1e3
            ax.broken_barh([(x, (e.done - e.start) * 1e3)], (-0.45, 0.9), facecolors="none",
                           edgecolors="black", linewidth=1.2)
            name = f"step {numbers[id(e)]}" if e.kind == EventKind.STEP else e.kind
            ax.text(max(x, 0) + 1, -0.47, f"{name}: {(e.done - e.start) * 1e3:.0f} ms", fontsize=8,
                    va="bottom", clip_on=True)


def _patch(color: str, label: str):
    from matplotlib.patches import Patch
    return Patch(facecolor=color, label=label)


# -- distributions ---------------------------------------------------------
def _cdf(ax, events: Sequence[Event], summary: Summary) -> None:
    ms = sorted((e.done - e.start) * 1e3 for e in events if e.kind == EventKind.STEP)
    ax.set_title("decode step latency CDF", loc="left")
    if not ms:
        ax.text(0.5, 0.5, "no decode steps", ha="center", transform=ax.transAxes)
        return
    ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", color="black")
    for name, color in (("p50", "#3182bd"), ("p90", "#e6550d"), ("p99", "#d62728")):
        value = summary.step_ms[name]
        ax.axvline(value, color=color, linestyle="--", linewidth=1)
        ax.text(value, 0.02, f" {name} {value:.0f} ms", color=color, rotation=90, va="bottom", fontsize=9)
    ax.set_xlabel("step latency (ms)")
    ax.set_ylabel("share of steps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def _by_link(ax, summary: Summary) -> None:
    ax.set_title(f"stall by tier link (% of {summary.phase_time})", loc="left")
    rows = [r for r in summary.by_link if r.of_stall >= MIN_SHARE][::-1]
    if not rows:
        ax.text(0.5, 0.5, "no stall", ha="center", transform=ax.transAxes)
        return
    per_kind = _kind_seconds(summary, lambda c: c.link)
    left = [0.0] * len(rows)
    for kind in STALL_KINDS:
        widths = [100 * per_kind[r.key].get(kind, 0.0) / summary.phase_s for r in rows]
        if sum(widths) >= 100 * MIN_SHARE * summary.stall_s / summary.phase_s:
            ax.barh([r.key for r in rows], widths, left=left, height=0.5, color=_stall_color(kind),
                    label=STALL_KINDS[kind])
            left = [a + b for a, b in zip(left, widths)]
    for y, (r, x) in enumerate(zip(rows, left)):
        ax.text(x, y, f"  {100 * r.of_time:.1f} %  ({r.waits} waits)", va="center", fontsize=9)
    pad = max(0.75, (3 - len(rows)) * 0.6)   # a lone bar stays a bar, not a wall
    ax.set_ylim(-pad, len(rows) - 1 + pad)
    ax.set_xlim(0, max(left) * 1.5)
    ax.set_xlabel("% of time stalled")
    ax.legend(fontsize=9, loc="lower right")


def _by_layer(ax, summary: Summary) -> None:
    from matplotlib.ticker import MaxNLocator
    per = max(summary.steps, 1) if summary.phase == "decode" else 1
    ax.set_title("stall by layer" + (" (ms per step)" if per > 1 else " (ms)"), loc="left")
    per_kind = _kind_seconds(summary, lambda c: c.layer)
    layers = sorted(x for x in per_kind if x is not None)
    if not layers:
        ax.text(0.5, 0.5, "no stall", ha="center", transform=ax.transAxes)
        return
    bottom = [0.0] * len(layers)
    for kind in STALL_KINDS:
        heights = [1e3 * per_kind[x].get(kind, 0.0) / per for x in layers]
        if sum(heights) >= 1e3 * MIN_SHARE * summary.stall_s / per:
            ax.bar(layers, heights, bottom=bottom, color=_stall_color(kind), label=STALL_KINDS[kind], width=0.8)
            bottom = [a + b for a, b in zip(bottom, heights)]
    ax.set_ylim(0, max(bottom) * 1.12)
    ax.set_xlim(min(layers) - 0.6, max(layers) + 0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("stall ms per step" if per > 1 else "stall ms")
    ax.legend(fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def _kind_seconds(summary: Summary, key) -> dict[object, dict[str, float]]:
    """Stall seconds per transfer kind, grouped by ``key(cause)`` (a link or a layer)."""
    out: dict[object, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in summary.causes:
        for kind, seconds in (c.kinds or {"": c.seconds}).items():
            out[key(c)][kind] += seconds
    return out


def _stall_color(kind: str) -> str:
    return KIND_COLORS.get(kind, "#bdbdbd")
