"""``tierkv tune TRACE``: rank eviction policies and settings by replaying an access trace.

Every point of the grid (policies x ``--grid`` values) replays the trace
(`tierkv.tune.replay`) under one tier model; points rank by modelled stall
(seconds the reader waited in gets), then by bytes moved between tiers::

    --policies lru,arc          -> policy   on every memory tier (gpu, cpu)
    --grid gpu_budget=64MiB,128MiB --prefetch none,next-layer
    = 2 x 2 x 2 = 8 replays     -> table, --json, --plot, and the best as a run config

Prefetchers are named as ``tierkv run`` names them for the engine that
recorded the trace (`tierkv.tune.prefetchers`): ``--prefetch`` names for a
trace of the dense engine, ``--sparse-prefetch`` names (none, speculative,
previous-step) for one of the sparse engine (``tierkv run --mode sparse``);
``--prefetch A,B`` is short for ``--grid prefetch=A,B``.

The tier model comes from ``--links FILE`` (``TierModel.from_dict`` JSON,
given by hand) or else from `tierkv.profile.probe` (this machine, cached).

The run config (``--out``, default the trace's path with the suffix ``.best.json``: ``run.tkv`` ->
``run.best.json``) uses the names of ``tierkv run`` flags, so ``tierkv run --config FILE`` reads it::

    {"format": "tierkv-run-config", "version": 1,
     "gpu_budget": "64MiB", "cpu_budget": "1GiB", "nvme_budget": "64GiB",   sizes as the flags take them
     "gpu_policy": "arc", "cpu_policy": "arc", "nvme_policy": "lru",        make_policy names
     "prefetch": "next-layer",                                               a dense trace: --prefetch's name
     "sparse_prefetch": "speculative",                                       a sparse one: --sparse-prefetch's
     "tuned": {...}}                                                         provenance; run ignores it

A dense trace's ``none`` is written as ``none``, although the engine then
still reads one group ahead within a layer, which that replay left out.
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies import available, make_policy
from tierkv.flags import check_not_read, check_writable, path_arg
from tierkv.sizes import format_size, parse_size
from tierkv.errors import ConfigError, TierKVError
from tierkv.profile.access_trace import AccessTrace, TraceMeta
from tierkv.profile.plots import check_plot_path, matplotlib_canvas
from tierkv.tune.prefetchers import VOCABULARIES, resolve_prefetch
from tierkv.tune.replay import ReplayConfig, ReplayResult, replay
from tierkv.tune.tier_model import TierModel
from tierkv.tiers.nvme_share import prepare_store_dir

CONFIG_FORMAT, CONFIG_VERSION = "tierkv-run-config", 1
RUN_KEYS = ("mode", "gpu_budget", "cpu_budget", "cxl_budget", "nvme_budget", "gpu_policy", "cpu_policy", "cxl_policy",
            "nvme_policy", "prefetch", "sparse_prefetch")
# Keys a user may expect that a recorded trace cannot vary, and why.
FIXED_BY_TRACE = {
    "block_tokens": "the trace's blocks have a fixed size; record one trace per block size",
    "chunk_tokens": "the trace's calls follow the recorded chunking; record one trace per chunk size",
    "sparse_budget": "the trace holds the blocks one run read; record one trace per sparse budget",
}
Point = dict[str, str]


# -- the grid -------------------------------------------------------------------
def grid_keys(meta: TraceMeta) -> list[str]:
    """Keys ``--grid`` accepts for a trace with these tiers."""
    tiers = [t.name for t in meta.tiers]
    return ["policy", *(f"{t}_policy" for t in tiers), *(f"{t}_budget" for t in tiers), "prefetch"]


def parse_grid(items: Sequence[str], meta: TraceMeta, policies: Sequence[str] | None = None) -> list[Point]:
    """Every combination of ``key=v1,v2`` items (and the ``policies`` axis); one dict per point."""
    axes: dict[str, list[str]] = {}
    for item in items:
        key, values = _grid_item(item, meta)
        if key == "policy" and policies is not None:
            raise ConfigError("--grid policy= and --policies: name the policies once")
        if key in axes:
            raise ConfigError(f"--grid {key}: given twice; give its values in one --grid {key}=v1,v2")
        axes[key] = list(dict.fromkeys(values))                 # (a value named twice is replayed once)
    if policies is not None:
        axes["policy"] = list(dict.fromkeys(policies))
    elif not any(key.endswith("policy") for key in axes):
        axes["policy"] = available()
    for key, values in axes.items():
        for value in values:
            _check_value(key, value, meta)
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def _grid_item(item: str, meta: TraceMeta) -> tuple[str, list[str]]:
    key, sep, raw = item.partition("=")
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not sep or not values:
        raise ConfigError(f"--grid {item!r}: expected key=v1,v2,... (keys: {', '.join(grid_keys(meta))})")
    if key in FIXED_BY_TRACE:
        raise ConfigError(f"--grid {key}: cannot vary in a replay: {FIXED_BY_TRACE[key]}")
    if key not in grid_keys(meta):
        raise ConfigError(f"--grid {key}: unknown key; for this trace: {', '.join(grid_keys(meta))}")
    return key, values


def _check_value(key: str, value: str, meta: TraceMeta) -> None:
    if key.endswith("_budget"):
        if parse_size(value, key) < meta.block_bytes:
            raise ConfigError(f"{key}={value}: holds no block of this trace ({format_size(meta.block_bytes)})")
    elif key.endswith("policy"):
        make_policy(value, capacity=1)   # loud: unknown names list the valid ones
    elif key == "prefetch":
        resolve_prefetch(value, meta)   # names what applies to this trace's engine


def replay_config(point: Mapping[str, str], meta: TraceMeta) -> ReplayConfig:
    policies, slots = {}, {}
    for tier in meta.tiers:
        chosen = point.get(f"{tier.name}_policy") or (point.get("policy") if tier.medium != "nvme" else None)
        if chosen:
            policies[tier.name] = chosen
        if f"{tier.name}_budget" in point:
            slots[tier.name] = parse_size(point[f"{tier.name}_budget"]) // meta.block_bytes
    return ReplayConfig(policies, point.get("prefetch"), slots)


# -- ranking --------------------------------------------------------------------
@dataclass(slots=True)
class Ranked:
    point: Point
    result: ReplayResult | None = None
    error: str = ""

    @property
    def key(self) -> tuple[float, float]:
        if self.result is None:
            return (float("inf"), float("inf"))
        return (round(self.result.stall_s, 9), self.result.moved_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {"setting": self.point, "result": None if self.result is None else self.result.as_dict(),
                "error": self.error}


def tune(trace: AccessTrace, model: TierModel, points: Sequence[Point],
         progress: Callable[[int], None] = lambda done: None) -> list[Ranked]:
    """Replay every point; best first (least stall, then fewest bytes moved; failures last)."""
    ranked = []
    for done, point in enumerate(points, 1):
        try:
            ranked.append(Ranked(point, replay(trace, model, replay_config(point, trace.meta))))
        except TierKVError as error:  # a budget too small for the trace: a result, not a crash
            ranked.append(Ranked(point, error=f"{type(error).__name__}: {error}"))
        progress(done)
    return sorted(ranked, key=lambda r: r.key)


def format_table(ranked: Sequence[Ranked], top: int | None = None) -> str:
    keys = list(dict.fromkeys(k for r in ranked for k in r.point))
    tiers = list(dict.fromkeys(t for r in ranked if r.result for t in r.result.hit_rates))
    rows = [["rank", *keys, "stall s", "decode stall s", "moved", *(f"{t} hits" for t in tiers)]]
    for rank, r in enumerate(ranked[:top], 1):
        rows.append([str(rank), *(r.point.get(k, "") for k in keys), *_metrics(r, tiers)])
    sized = [row for row in rows if len(row) == len(rows[0])]  # a failure's message spans the metrics
    widths = [max(len(row[i]) for row in sized) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def tie_note(ranked: Sequence[Ranked]) -> str | None:
    """What to say where settings tie with the best (the same modelled stall and bytes moved): the trace
    does not tell them apart, and the one written is only the first listed."""
    if not ranked or ranked[0].result is None:
        return None
    tied = sum(1 for r in ranked if r.key == ranked[0].key)
    return None if tied < 2 else (f"ranks 1-{tied} tie (the same modelled stall and bytes moved): this trace "
                                  "does not tell them apart, and the best written is the first of them")


def _metrics(r: Ranked, tiers: list[str]) -> list[str]:
    if r.result is None:
        return [f"failed: {r.error}"]
    res = r.result
    return [f"{res.stall_s:.4f}", f"{res.decode_stall_s:.4f}", format_size(res.moved_bytes),
            *(f"{100 * res.hit_rates[t]:.1f} %" if t in res.hit_rates else "-" for t in tiers)]   # (no read
                                                                                                    # got there)


# -- the run config -------------------------------------------------------------
def run_config(best: Ranked, meta: TraceMeta, *, source: str = "") -> dict[str, Any]:
    """The best point as ``tierkv run`` flag values (tiers it did not vary keep the trace's)."""
    if best.result is None:
        raise ConfigError(f"no setting replayed without error; the best failed with {best.error}")
    config: dict[str, Any] = {"format": CONFIG_FORMAT, "version": CONFIG_VERSION}
    if meta.engine == "sparse":                   # (auto runs a short document dense: not what was tuned)
        config["mode"] = "sparse"
    chosen = replay_config(best.point, meta)
    for tier in meta.tiers:
        slots = chosen.slots.get(tier.name, tier.slots)
        config[f"{tier.name}_budget"] = best.point.get(f"{tier.name}_budget") or _size_text(slots * meta.block_bytes)
        config[f"{tier.name}_policy"] = chosen.policies.get(tier.name) or _registered_name(tier.policy)
    config[VOCABULARIES[meta.engine].config_key] = best.result.prefetch   # the flag of the recording engine
    config["tuned"] = {"trace": source, **best.result.as_dict()}
    return config


def write_run_config(path: Path, config: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(config, indent=2) + "\n")


def read_run_config(path: Path) -> dict[str, Any]:
    """The ``tierkv run`` flag values in a config file (provenance dropped); ConfigError names what is wrong."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the run config: {err.strerror or err}") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not JSON: {err}") from None
    if not isinstance(raw, dict) or raw.get("format") != CONFIG_FORMAT:
        found = f"format {raw.get('format')!r}" if isinstance(raw, dict) else f"a JSON {type(raw).__name__}"
        raise ConfigError(f"{path}: not a {CONFIG_FORMAT} file ({found})")
    if isinstance(raw.get("version"), bool) or raw.get("version") != CONFIG_VERSION:
        raise ConfigError(f"{path}: {CONFIG_FORMAT} version {raw.get('version')!r}; this tierkv reads version "
                          f"{CONFIG_VERSION}")
    values = {k: v for k, v in raw.items() if k not in ("format", "version", "tuned")}
    unknown = sorted(set(values) - set(RUN_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; allowed: {', '.join(RUN_KEYS)}")
    for key, value in values.items():
        if key.endswith("_budget"):
            parse_size(value, key)
        elif not isinstance(value, str):
            raise ConfigError(f"{path}: {key}={value!r}: expected a name")
    return values


def _registered_name(spec: str) -> str:
    """``policies.lru:LRUPolicy`` (how a trace names a policy) as ``lru`` where it is registered."""
    names = {f"{type(p).__module__}:{type(p).__qualname__}": name
             for name in available() for p in [make_policy(name)]}
    return names.get(spec, spec)


def _size_text(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# -- the tier model ---------------------------------------------------------------
def tier_model_from_probe(probe: Mapping[str, Any]) -> TierModel:
    """Links measured by `tierkv.profile.probe` as a replay model; disk reads and writes share a channel."""
    measured = probe["links"]
    as_link = {"cpu->cpu": "*->*", "cpu->gpu": "*->gpu", "gpu->cpu": "gpu->*",
               "nvme->cpu": "nvme->*", "cpu->nvme": "*->nvme"}
    links = {}
    for name, pattern in as_link.items():
        if name in measured:
            link = measured[name]
            links[pattern] = {"gbps": link["gbps"], "latency_us": link["latency_us"],
                              "queue_depth": link["queue_depth"], "channel": "nvme" if "nvme" in name else ""}
    return TierModel.from_dict({"links": links})


def load_tier_model(links: Path | None, nvme_dir: Path | None, *, refresh: bool = False) -> TierModel:
    if links is not None:
        try:
            return TierModel.from_dict(json.loads(Path(links).read_text()))
        except OSError as err:
            raise ConfigError(f"--links {links}: cannot read: {err.strerror or err}") from None
        except ValueError as err:
            raise ConfigError(f"--links {links}: not a tier model: {err}") from None
    from tierkv.profile.probe import cache_path, probe_links
    return tier_model_from_probe(probe_links(nvme_dir or cache_path().parent, refresh=refresh))


# -- plot -----------------------------------------------------------------------
def plot_ranking(ranked: Sequence[Ranked], path: Path, top: int = 20) -> None:
    """Bars of modelled stall and of bytes moved, best setting first (matplotlib Agg)."""
    Figure, FigureCanvasAgg = matplotlib_canvas()
    shown = [r for r in ranked if r.result is not None][:top]
    labels = [" ".join(r.point.values()) for r in shown]
    fig = Figure(figsize=(10, 2 + 0.35 * len(shown)), layout="constrained")
    FigureCanvasAgg(fig)
    stall, moved = fig.subplots(1, 2, sharey=True)
    stall.barh(labels, [r.result.stall_s for r in shown], color="#d62728")
    moved.barh(labels, [r.result.moved_bytes / 2**20 for r in shown], color="#3182bd")
    stall.invert_yaxis()
    stall.set_xlabel("modelled stall (s)")
    moved.set_xlabel("moved between tiers (MiB)")
    fig.suptitle(f"tierkv tune: {len(shown)} best of {len(ranked)} settings")
    fig.savefig(path)


# -- the command ------------------------------------------------------------------
def add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="rank eviction/prefetch policies and budgets by replaying an access trace",
                       description="Replay an access trace under every policy and --grid setting, rank them "
                                   "by modelled stall then bytes moved, and write the best as a run config.")
    p.add_argument("trace", type=path_arg, help="access trace recorded by tierkv (tierkv.profile.access)")
    p.add_argument("--policies", help="eviction policies for the memory tiers, comma-separated "
                                      f"(default: all: {', '.join(available())}; 'module:Class' works too)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="more values to try: <tier>_budget, <tier>_policy, prefetch; repeatable")
    p.add_argument("--prefetch", metavar="A,B", help="prefetchers to rank, comma-separated (short for --grid "
                   "prefetch=A,B), as tierkv run names them for the engine that recorded the trace: "
                   + "; ".join(f"{engine} {v.flag} ({', '.join(v.names())})" for engine, v in VOCABULARIES.items()))
    p.add_argument("--links", type=path_arg, help="tier model JSON (link gbps, latency_us, queue_depth) "
                                              "instead of this machine's probe")
    p.add_argument("--nvme-dir", type=path_arg, help="where the probe measures the disk (default: the cache dir)")
    p.add_argument("--reprobe", action="store_true", help="measure this machine again instead of the cache")
    p.add_argument("--out", type=path_arg, help="best setting as a run config (default: the trace with the suffix "
                                            ".best.json, run.tkv -> run.best.json)")
    p.add_argument("--top", type=int, default=20, help="rows to print and plot (default 20)")
    p.add_argument("--plot", type=path_arg, metavar="OUT.png", help="bar chart of stall and bytes (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise ConfigError(f"--top={args.top}: must be >= 1")
    out = args.out or args.trace.with_suffix(".best.json")
    check_not_read({"--out" if args.out else "the default --out": out}, {"input": args.trace, "--links": args.links})
    trace = AccessTrace.read(args.trace)
    check_writable("--out", out)                  # before the replays, not after them
    if args.plot is not None:
        check_plot_path(args.plot)
    policies = None if args.policies is None else [p.strip() for p in args.policies.split(",") if p.strip()]
    if policies == []:
        raise ConfigError(f"--policies {args.policies!r}: names no policy; give names such as lru,arc "
                          f"(available: {', '.join(available())})")
    points = parse_grid(_grid_items(args.grid, args.prefetch), trace.meta, policies)
    if args.nvme_dir is not None:
        prepare_store_dir(args.nvme_dir)      # the probe writes there
    model = load_tier_model(args.links, args.nvme_dir, refresh=args.reprobe)
    ranked = _tune_with_progress(trace, model, points, quiet=args.json)
    write_run_config(out, run_config(ranked[0], trace.meta, source=str(args.trace)))
    if args.plot is not None:
        plot_ranking(ranked, args.plot, args.top)
    if args.json:
        note = tie_note(ranked)
        print(json.dumps({"trace": str(args.trace), "model": model.as_dict(), "best_config": str(out),
                          "ranking": [r.as_dict() for r in ranked]} | ({"note": note} if note else {}), indent=2))
        return 0
    print(format_table(ranked, args.top))
    if note := tie_note(ranked):
        print(f"note: {note}")
    print(f"\nbest setting written to {out} (tierkv run --config {out})")
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0


def _grid_items(grid: list[str], prefetch: str | None) -> list[str]:
    """``--grid`` items, with ``--prefetch A,B`` as ``prefetch=A,B``."""
    if prefetch is None:
        return grid
    if any(item.partition("=")[0] == "prefetch" for item in grid):
        raise ConfigError("--prefetch and --grid prefetch=: name the prefetchers once")
    return [*grid, f"prefetch={prefetch}"]


def _tune_with_progress(trace: AccessTrace, model: TierModel, points: list[Point], *, quiet: bool) -> list[Ranked]:
    import sys

    from tqdm import tqdm
    with tqdm(total=len(points), unit="setting", desc="replay", file=sys.stderr, disable=quiet,
              dynamic_ncols=True) as bar:
        return tune(trace, model, points, progress=lambda done: bar.update(done - bar.n))
