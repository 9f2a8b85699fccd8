"""``tierkv profile TRACE``: what a trace written by ``tierkv run --trace`` says to act on.

Prints step latency percentiles, stall per tier link and per layer, the top
stall causes, achieved GB/s per link next to its measured limit, and where
reads were served from (see tierkv.profile.summary for the definitions);
``--plot OUT.png`` draws it, ``--json`` prints it as one object.
"""
from __future__ import annotations

import argparse
import json

from tierkv.errors import ConfigError
from tierkv.flags import path_arg
from tierkv.profile.summary import PHASES, summarize
from tierkv.profile.summary_text import format_summary
from tierkv.profile.trace import read_trace


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="summarize a trace from `tierkv run --trace`: latency, stalls, links",
                       description="Read a trace written by `tierkv run --trace FILE` and report step latency "
                                   "p50/p90/p99, stall per tier link and per layer, the top stall causes, "
                                   "achieved GB/s per link and hit rates.")
    p.add_argument("trace", type=path_arg, help="trace JSON written by `tierkv run --trace FILE`")
    p.add_argument("--plot", type=path_arg, metavar="OUT.png",
                   help="also draw a timeline, the step-latency CDF and stall by link and layer (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--phase", choices=PHASES, default="decode",
                   help="which part of the run the stall tables cover (default: decode)")
    p.add_argument("--top", type=int, default=5, help="how many stall causes to list (default 5)")
    p.add_argument("--steps", type=int, default=3, help="decode steps the plot's timeline shows (default 3)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.top < 1 or args.steps < 1:
        raise ConfigError(f"--top={args.top}, --steps={args.steps}: both must be >= 1")
    if args.plot is not None:
        from tierkv.profile.plots import check_plot_path
        check_plot_path(args.plot)
    trace = read_trace(args.trace)
    summary = summarize(trace.events, trace.meta, phase=args.phase)
    if args.plot is not None:
        from tierkv.profile.plots import plot_profile
        plot_profile(trace.events, summary, args.plot, steps=args.steps)
    if args.json:
        print(json.dumps({"trace": str(trace.path), **summary.as_dict(args.top)}, indent=2))
    else:
        print(format_summary(summary, str(trace.path), args.top))
        if args.plot is not None:
            print(f"plots written to {args.plot}")
    return 0
