"""Replaying a sparse engine's trace: its prefetchers by name, the recorded guesses, clear errors.

The traces are written by hand as the sparse engine records them: per decode step and layer, the
layer's read of the pages it selected, then (while it computes) its guess at layer l+1's pages.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import AccessTrace, OpKind, TierSpec, TraceMeta
from tierkv.tune.prefetchers import Prefetch, previous_step_prefetch, speculative_prefetch
from tierkv.tune.replay import ReplayConfig, replay
from tierkv.tune.tier_model import Link, TierModel
from tierkv.tune.tune import parse_grid, run_config, tune

BLOCK = 64 * 1024
LAYERS, READ, PICK = 4, 12, 4      # pages 0..11 of a layer are ever read; 12..15 never
DISK = TierModel({"nvme->*": Link(gbps=1.0, latency_us=100, queue_depth=4, channel="nvme"),
                  "*->nvme": Link(gbps=1.0, latency_us=100, queue_depth=4, channel="nvme"),
                  "*->*": Link(gbps=10.0)})   # 4 pages in ~0.36 ms; 1 ms of compute between calls


def page(layer: int, i: int) -> BlockKey:
    return BlockKey.of("page", layer, i)


def sparse_trace(guesses: str = "right", steps: int = 6, seed: int = 0) -> AccessTrace:
    """``guesses``: "right" (layer l+1's own selection), "wrong" (pages it never reads) or "none"."""
    rng, now = random.Random(seed), [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]

    rec = AccessRecorder(clock=clock)
    for _ in range(steps):
        rec.begin_step("decode", 1)
        chosen = [rng.sample(range(READ), PICK) for _ in range(LAYERS)]
        for layer in range(LAYERS):
            rec.on_acquire([page(layer, i) for i in chosen[layer]], layer)
            if guesses != "none" and layer + 1 < LAYERS:
                guess = chosen[layer + 1] if guesses == "right" else range(READ, READ + PICK)
                rec.on_guess([page(layer + 1, i) for i in guess], layer + 1, "speculative")
    tiers = (TierSpec("gpu", "gpu", 12), TierSpec("nvme", "nvme", 1024))
    info = {"engine": "sparse"} if guesses == "none" else {}
    return rec.trace(meta=TraceMeta(BLOCK, tiers, layers=LAYERS, info=info), events=[])


def ranking(trace: AccessTrace, names: str) -> list[str]:
    ranked = tune(trace, DISK, parse_grid([f"prefetch={names}"], trace.meta, ["lru"]))
    return [r.point["prefetch"] for r in ranked]


def test_a_trace_with_guesses_is_the_sparse_engine_s() -> None:
    trace = sparse_trace()
    assert trace.meta.engine == "sparse" and trace.meta.sources == ("speculative",)
    assert trace.guesses("speculative").tolist() == [i for i in range(trace.n_ops)
                                                     if trace.op_kind[i] == OpKind.GUESS]
    assert sparse_trace("none").meta.engine == "sparse"     # no guesses, but the run said so


def test_right_guesses_rank_speculative_above_none() -> None:
    trace = sparse_trace("right")
    none, speculative = (replay(trace, DISK, ReplayConfig(prefetch=name)) for name in ("none", "speculative"))
    assert speculative.prefetch == "speculative" and none.prefetch == "none"
    assert speculative.stall_s < 0.5 * none.stall_s
    assert ranking(trace, "none,speculative") == ["speculative", "none"]


def test_wrong_guesses_rank_speculative_below_none() -> None:
    trace = sparse_trace("wrong")
    none, speculative = (replay(trace, DISK, ReplayConfig(prefetch=name)) for name in ("none", "speculative"))
    assert speculative.stall_s >= none.stall_s and speculative.moved_bytes > none.moved_bytes
    assert ranking(trace, "speculative,none") == ["none", "speculative"]


def test_a_layer_whose_guesses_held_under_half_is_skipped() -> None:
    right, wrong = sparse_trace("right"), sparse_trace("wrong")
    assert len(speculative_prefetch(right)) == len(right.guesses("speculative"))   # every guess issued
    issued = speculative_prefetch(wrong)
    first_step = [i for i in wrong.guesses("speculative").tolist() if wrong.op_step[i] == 0]
    assert [p.at for p in issued] == first_step     # scored 0 when the next guess came: stopped after one
    assert all(p.guess and p.at == p.target and p.blocks is None for p in issued)


def test_previous_step_prefetches_the_next_layer_s_pages_of_the_step_before() -> None:
    trace = sparse_trace("none", steps=2)
    start = trace.op_start()
    gets = {(int(trace.op_step[i]), int(trace.op_layer[i])): i for i in range(trace.n_ops)}
    plan = previous_step_prefetch(trace)
    assert len(plan) == LAYERS - 1                    # step 1, layers 0..2; nothing in the first step
    for layer, p in enumerate(plan):
        read = gets[(0, layer + 1)]
        assert p == Prefetch(gets[(1, layer)], 0.0, read, tuple(trace.block[start[read]:start[read + 1]].tolist()),
                             guess=True)
    result = replay(trace, DISK, ReplayConfig(prefetch="previous-step"))
    assert result.prefetch == "previous-step" and result.moved_bytes > 0


def test_the_run_config_of_a_sparse_trace_names_the_sparse_prefetch() -> None:
    trace = sparse_trace("right")
    ranked = tune(trace, DISK, parse_grid(["prefetch=none,speculative"], trace.meta, ["lru"]))
    config = run_config(ranked[0], trace.meta)
    assert config["sparse_prefetch"] == "speculative" and "prefetch" not in config
    default = tune(trace, DISK, parse_grid([], trace.meta, ["lru"]))[0]
    assert default.result.prefetch == "none"          # not varied: the sparse engine's own default


@pytest.mark.parametrize("trace, name, message", [
    (lambda: sparse_trace(), "next-layer",
     r"prefetch='next-layer': not one of the sparse engine's, which recorded this trace; its prefetchers "
     r"\(tierkv run --sparse-prefetch\): none, speculative, previous-step"),
    (lambda: sparse_trace("none"), "speculative", "holds none: record it with `tierkv run --mode sparse"),
    (lambda: sparse_trace(), "engine", "prefetch='engine': not one of the sparse engine's"),
])
def test_a_prefetcher_of_the_other_engine_is_a_clear_error(trace, name: str, message: str) -> None:
    made = trace()
    with pytest.raises(ConfigError, match=message):
        replay(made, DISK, ReplayConfig(prefetch=name))
    with pytest.raises(ConfigError, match=message):
        parse_grid([f"prefetch={name}"], made.meta, ["lru"])


@pytest.mark.model
@pytest.mark.slow
def test_a_recorded_sparse_run_ranks_its_speculative_guesses(tmp_path) -> None:
    """tierkv run --mode sparse records the engine's guesses; tierkv tune replays them against none."""
    def tierkv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tierkv.cli", *args], capture_output=True, text=True, timeout=300)

    trace, links = tmp_path / "sparse.tkv", tmp_path / "links.json"
    links.write_text(json.dumps(DISK.as_dict()))
    ran = tierkv("run", "--mode", "sparse", "--synthetic-tokens", "1200", "--max-new-tokens", "4",
                 "--sparse-budget", "256", "--nvme-dir", str(tmp_path / "store"), "--gpu-budget", "4MiB",
                 "--cpu-budget", "4MiB", "--record-access", str(trace), "--json")
    assert ran.returncode == 0, ran.stderr
    recorded = AccessTrace.read(trace)
    assert recorded.meta.engine == "sparse" and len(recorded.guesses("speculative")) > 0
    tuned = tierkv("tune", str(trace), "--prefetch", "speculative,none", "--policies", "lru", "--links", str(links),
                   "--json", "--out", str(tmp_path / "best.json"))
    assert tuned.returncode == 0, tuned.stderr
    ranking = [(r["setting"]["prefetch"], r["result"]["stall_s"]) for r in json.loads(tuned.stdout)["ranking"]]
    assert [name for name, _ in ranking] == ["speculative", "none"] and ranking[0][1] < ranking[1][1]
    best = json.loads((tmp_path / "best.json").read_text())
    assert best["sparse_prefetch"] == "speculative" and "prefetch" not in best
