"""Tune your own eviction policy: replay an access trace under it and the built-ins, keep the best.

The policy lives in its own file, ``examples/my_policy.py`` (MRU: evict the
most recently used block). tierkv loads it by ``module:Class`` name; nothing
in tierkv changes. A decode step reads every layer's KV front to back, a loop
larger than the fast tiers, where LRU always evicts the block needed next
and MRU keeps a stable part of the loop resident; on a slow disk that is
worth more than what prefetching recovers for LRU::

    python examples/tune_my_policy.py                     # a synthetic decode trace, links given by hand
    python examples/tune_my_policy.py TRACE --probe       # a recorded trace, links measured on this machine
    python examples/tune_my_policy.py --out best.json     # the best configuration, for tierkv run --config

The same from the command line (with examples/ importable)::

    PYTHONPATH=examples tierkv tune TRACE --policies lru,arc,my_policy:MostRecentlyUsed \\
        --grid gpu_budget=8MiB,16MiB --grid prefetch=none,next-layer
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # makes my_policy importable by name

from tierkv.keys import BlockKey  # noqa: E402
from tierkv.profile.access import AccessRecorder  # noqa: E402
from tierkv.profile.access_trace import AccessTrace, TierSpec, TraceMeta  # noqa: E402
from tierkv.tune.tier_model import TierModel  # noqa: E402
from tierkv.tune.tune import (format_table, load_tier_model, parse_grid, run_config,  # noqa: E402
                                 tune, write_run_config)

MY_POLICY = "my_policy:MostRecentlyUsed"
MiB = 2**20
# Given by hand: a fast host link and a slow disk, one channel shared by its reads and writes.
HAND_MODEL = {"links": {"*->*": {"gbps": 10.0, "latency_us": 5.0},
                        "nvme->*": {"gbps": 1.0, "latency_us": 100.0, "queue_depth": 4, "channel": "nvme"},
                        "*->nvme": {"gbps": 1.0, "latency_us": 100.0, "queue_depth": 4, "channel": "nvme"}}}


def decode_trace(layers: int = 4, blocks: int = 16, steps: int = 4, group: int = 4) -> AccessTrace:
    """What the native loop asks of the tiers: prefill stores each layer's blocks, then every
    decode step reads every layer ``group`` blocks at a time, 1 ms of compute before each call."""
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]

    recorder = AccessRecorder(clock=clock)
    keys = [[BlockKey.of("example", layer, i) for i in range(blocks)] for layer in range(layers)]
    recorder.begin_step("prefill", blocks * 256)
    for i in range(blocks):
        for layer in range(layers):
            recorder.on_put(keys[layer][i], layer)
    for _ in range(steps):
        recorder.begin_step("decode", 1)
        for layer in range(layers):
            for start in range(0, blocks, group):
                recorder.on_acquire(keys[layer][start:start + group], layer)
    tiers = (TierSpec("gpu", "gpu", 8), TierSpec("cpu", "cpu", 16), TierSpec("nvme", "nvme", 1024))
    return recorder.trace(meta=TraceMeta(block_bytes=MiB, tiers=tiers, layers=layers), events=[])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", type=Path, help="a recorded access trace (default: a synthetic one)")
    parser.add_argument("--probe", action="store_true", help="link speeds measured on this machine (cached)")
    parser.add_argument("--out", type=Path, help="write the best configuration there (default: print it)")
    args = parser.parse_args()

    source = str(args.trace) if args.trace is not None else "a synthetic decode trace (examples/tune_my_policy.py)"
    with tempfile.TemporaryDirectory(prefix="tierkv-tune-") as scratch:
        if args.trace is None:
            args.trace = Path(scratch) / "decode.tkv"
            decode_trace().write(args.trace)
        trace = AccessTrace.read(args.trace)
    model = load_tier_model(None, None) if args.probe else TierModel.from_dict(HAND_MODEL)

    points = parse_grid(["gpu_budget=8MiB,16MiB", "prefetch=none,next-layer"], trace.meta,
                        ["lru", "arc", MY_POLICY])
    ranked = tune(trace, model, points)
    print(format_table(ranked))

    config = run_config(ranked[0], trace.meta, source=source)     # (not the scratch file, gone by then)
    if args.out is None:
        print(f"\nbest: {ranked[0].point}:\n{json.dumps(config, indent=2)}\n(--out FILE writes it for "
              f"tierkv run --config FILE)")
    else:
        write_run_config(args.out, config)
        print(f"\nbest: {ranked[0].point}; written to {args.out} (tierkv run --config {args.out})")


if __name__ == "__main__":
    main()
