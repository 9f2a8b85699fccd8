"""``tierkv tune``: the grid, the ranking, the run config it writes, and the command end to end.

Traces are synthetic and small (a few dozen calls) so every replay takes a fraction of a second.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

import policies.h2o  # noqa: F401  registered by policies/__init__ once wired; imported here to be sure
import policies.streaming  # noqa: F401
from policies import available
from tierkv.errors import ConfigError
from tierkv.keys import BlockKey
from tierkv.tune import tune as tune_module
from tierkv.profile.access import AccessRecorder
from tierkv.profile.access_trace import AccessTrace, TierSpec, TraceMeta
from tierkv.tune.tier_model import TierModel
from tierkv.tune.tune import (Ranked, add_tune, format_table, tie_note, grid_keys, parse_grid,
                                 read_run_config, replay_config, run_config, tier_model_from_probe, tune,
                                 write_run_config)

MiB = 2**20
LINKS = {"links": {"*->*": {"gbps": 10.0, "latency_us": 5.0},
                   "nvme->*": {"gbps": 1.0, "latency_us": 100.0, "queue_depth": 4, "channel": "nvme"},
                   "*->nvme": {"gbps": 1.0, "latency_us": 100.0, "queue_depth": 4, "channel": "nvme"}}}


def decode_trace(layers: int = 2, blocks: int = 8, steps: int = 3, group: int = 2,
                 gpu: int = 4, cpu: int = 6) -> AccessTrace:
    """Prefill stores every block, then each decode step reads every layer a group at a time."""
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3  # 1 ms of compute before each call
        return now[0]

    recorder = AccessRecorder(clock=clock)
    keys = [[BlockKey.of("block", layer, i) for i in range(blocks)] for layer in range(layers)]
    recorder.begin_step("prefill", blocks * 16)
    for i in range(blocks):
        for layer in range(layers):
            recorder.on_put(keys[layer][i], layer)
    for _ in range(steps):
        recorder.begin_step("decode", 1)
        for layer in range(layers):
            for start in range(0, blocks, group):
                recorder.on_acquire(keys[layer][start:start + group], layer)
    tiers = (TierSpec("gpu", "gpu", gpu, "policies.lru:LRUPolicy"), TierSpec("cpu", "cpu", cpu),
             TierSpec("nvme", "nvme", 256))
    return recorder.trace(meta=TraceMeta(block_bytes=MiB, tiers=tiers, layers=layers), events=[])


@pytest.fixture(scope="module")
def trace() -> AccessTrace:
    return decode_trace()


@pytest.fixture(scope="module")
def model() -> TierModel:
    return TierModel.from_dict(LINKS)


# -- the grid ---------------------------------------------------------------------
def test_the_grid_is_every_combination_with_all_policies_by_default(trace: AccessTrace) -> None:
    points = parse_grid(["gpu_budget=2MiB,4MiB", "prefetch=none,next-layer"], trace.meta)
    assert len(points) == 4 * len(available())
    assert {"gpu_budget": "4MiB", "prefetch": "none", "policy": "arc"} in points
    named = parse_grid([], trace.meta, ["lru", "h2o"])
    assert named == [{"policy": "lru"}, {"policy": "h2o"}]
    per_tier = parse_grid(["gpu_policy=fifo,lru"], trace.meta)
    assert per_tier == [{"gpu_policy": "fifo"}, {"gpu_policy": "lru"}]  # no policy axis added


@pytest.mark.parametrize("item,message", [
    ("gpu_budgets=1MiB", r"--grid gpu_budgets: unknown key; for this trace: policy, gpu_policy, cpu_policy"),
    ("block_tokens=128,256", "cannot vary in a replay: the trace's blocks have a fixed size"),
    ("gpu_budget", "expected key=v1,v2"),
    ("gpu_budget=512KiB", r"gpu_budget=512KiB: holds no block of this trace \(1.0 MiB\)"),
    ("gpu_budget=lots", "gpu_budget='lots': expected a size"),
    ("gpu_policy=mru", "policy='mru': unknown; valid names: arc, "),
    ("prefetch=eager", r"prefetch='eager': unknown; for a trace of the dense engine \(tierkv run --prefetch\): "
                       r"next-layer, next-layer-all, none, .*; for a trace of the sparse engine "
                       r"\(tierkv run --sparse-prefetch\): none, speculative, previous-step"),
    ("prefetch=speculative", "holds none: record it with `tierkv run --mode sparse --record-access FILE`"),
    ("policy=lru", "--grid policy= and --policies: name the policies once"),
])
def test_bad_grid_items_are_one_clear_error(trace: AccessTrace, item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_grid([item], trace.meta, ["arc"] if item.startswith("policy=") else None)


def test_a_grid_key_given_twice_is_named_and_a_value_named_twice_replayed_once(trace: AccessTrace) -> None:
    with pytest.raises(ConfigError, match="--grid gpu_budget: given twice; give its values in one --grid "
                                          "gpu_budget=v1,v2"):
        parse_grid(["gpu_budget=2MiB", "gpu_budget=4MiB"], trace.meta)
    points = parse_grid(["gpu_budget=2MiB,2MiB"], trace.meta, ["lru", "lru"])
    assert points == [{"gpu_budget": "2MiB", "policy": "lru"}]


def test_a_grid_item_the_user_wrote_is_shown_as_written(trace: AccessTrace, tmp_path: Path, capsys) -> None:
    """--grid cpu_budget= was shown as "--grid '--cpu-budget='": the user's own text rewritten as a flag."""
    from tierkv.cli import main
    trace.write(tmp_path / "run.tkv")
    assert main(["tune", str(tmp_path / "run.tkv"), "--grid", "cpu_budget="]) == 2
    assert "--grid 'cpu_budget=': expected key=v1,v2" in capsys.readouterr().err


def test_grid_keys_follow_the_trace_tiers(trace: AccessTrace) -> None:
    assert grid_keys(trace.meta) == ["policy", "gpu_policy", "cpu_policy", "nvme_policy",
                                     "gpu_budget", "cpu_budget", "nvme_budget", "prefetch"]


def test_a_point_becomes_a_replay_config(trace: AccessTrace) -> None:
    config = replay_config({"policy": "arc", "cpu_policy": "fifo", "gpu_budget": "3MiB", "prefetch": "none"},
                           trace.meta)
    assert dict(config.policies) == {"gpu": "arc", "cpu": "fifo"}  # "policy" leaves the store alone
    assert dict(config.slots) == {"gpu": 3} and config.prefetch == "none"
    assert replay_config({}, trace.meta).prefetch is None   # the recording engine's default


# -- ranking ----------------------------------------------------------------------
def test_more_memory_ranks_first(trace: AccessTrace, model: TierModel) -> None:
    points = parse_grid(["cpu_budget=2MiB,16MiB"], trace.meta, ["lru"])
    ranked = tune(trace, model, points)
    assert [r.point["cpu_budget"] for r in ranked] == ["16MiB", "2MiB"]
    assert "nvme" not in ranked[0].result.hit_rates             # no read got there: no rate ("0.0 %" said one)
    assert format_table(ranked).splitlines()[1].split()[-1] == "-"
    small, large = ranked[1].result, ranked[0].result
    assert large.stall_s == 0.0 < small.stall_s       # everything fits in memory: nothing to wait for
    assert large.moved_bytes < small.moved_bytes and small.bytes_by_link["nvme->gpu"] > 0
    assert tie_note(ranked) is None


def test_settings_the_trace_cannot_tell_apart_are_said_to_tie(trace: AccessTrace, model: TierModel) -> None:
    """Both fit everything: the same stall and bytes, and the first was written as the best, said of none."""
    ranked = tune(trace, model, parse_grid(["cpu_budget=16MiB,32MiB"], trace.meta, ["lru"]))
    assert ranked[0].key == ranked[1].key
    assert tie_note(ranked).startswith("ranks 1-2 tie (the same modelled stall and bytes moved)")


def test_rows_rank_by_stall_then_bytes_and_failures_go_last(trace: AccessTrace, model: TierModel) -> None:
    done: list[int] = []
    points = parse_grid(["gpu_budget=1MiB,4MiB", "cpu_budget=2MiB,3MiB"], trace.meta, ["lru", "arc"])
    ranked = tune(trace, model, points, progress=done.append)
    assert done == list(range(1, 9))
    keys = [(r.result.stall_s, r.result.moved_bytes) for r in ranked if r.result is not None]
    assert len(keys) == 4 and keys == sorted(keys)
    failed = ranked[4:]   # a group of 2 blocks cannot be read into a 1-block gpu tier
    assert all(r.result is None and r.point["gpu_budget"] == "1MiB" for r in failed)
    assert "BudgetExceeded: tier gpu: 2 blocks requested" in failed[0].error
    table = format_table(ranked).splitlines()
    assert table[0].split()[:5] == ["rank", "gpu_budget", "cpu_budget", "policy", "stall"]
    assert table[-1].split()[4:6] == ["failed:", "BudgetExceeded:"]
    assert len(format_table(ranked, top=1).splitlines()) == 2


def test_the_simulated_store_takes_the_calls_the_real_one_takes() -> None:
    """The simulated store's drop took no slot, which the eviction of a store block passes: a replay
    that evicted from the store crashed with a TypeError."""
    import inspect

    from tierkv.tiers.nvme import NvmeTier
    from tierkv.tune.simulation import SimStore
    for name in ("drop", "lookup", "items"):
        assert inspect.signature(getattr(SimStore, name)).parameters.keys() == \
            inspect.signature(getattr(NvmeTier, name)).parameters.keys(), name
    store = SimStore(TierSpec("nvme", "nvme", 8), MiB)
    store.seed([BlockKey.of("b", 0), BlockKey.of("b", 1)])
    store.drop(BlockKey.of("b", 1), 0)              # another slot: that copy is not this one
    assert store.lookup(BlockKey.of("b", 1)) == 1
    store.drop(BlockKey.of("b", 1), 1)
    assert store.lookup(BlockKey.of("b", 1)) is None


def test_attention_policies_replay_like_any_other(trace: AccessTrace, model: TierModel) -> None:
    ranked = tune(trace, model, parse_grid([], trace.meta, ["streaming", "h2o", "lru"]))
    assert all(r.result is not None for r in ranked)
    assert sorted("h2o" in r.result.policies["gpu"] for r in ranked) == [False, False, True]


# -- the run config -------------------------------------------------------------------
def test_the_best_setting_is_a_run_config_tierkv_run_can_read(trace: AccessTrace, model: TierModel,
                                                              tmp_path: Path) -> None:
    ranked = tune(trace, model, parse_grid(["gpu_budget=8MiB", "prefetch=engine"], trace.meta, ["arc"]))
    config = run_config(ranked[0], trace.meta, source="t.tkv")
    written = {k: config[k] for k in tune_module.RUN_KEYS if k in config}
    assert written == {
        "gpu_budget": "8MiB", "cpu_budget": "6MiB", "nvme_budget": "256MiB",
        "gpu_policy": "arc", "cpu_policy": "arc", "nvme_policy": "lru", "prefetch": "next-layer"}  # engine: its alias
    assert config["tuned"]["trace"] == "t.tkv" and config["tuned"]["stall_s"] == ranked[0].result.stall_s
    write_run_config(tmp_path / "best.json", config)
    assert read_run_config(tmp_path / "best.json") == written


def test_a_config_tuned_on_a_cxl_pool_or_a_sparse_run_is_one_tierkv_run_takes(model: TierModel,
                                                                                tmp_path: Path) -> None:
    """A pool's budget and policy were written, and refused by run as unknown keys; a sparse trace's
    config ran dense unless --mode sparse was given too."""
    from tierkv.flags import build, nest
    from tierkv.model.settings import RunConfig
    base = decode_trace()
    tiers = (*base.meta.tiers[:2], TierSpec("cxl", "cxl", 4), base.meta.tiers[2])
    pooled = dataclasses.replace(base, meta=TraceMeta(block_bytes=MiB, tiers=tiers, layers=2))
    ranked = tune(pooled, model, parse_grid(["cxl_budget=2MiB,8MiB"], pooled.meta, ["lru", "arc"]))
    write_run_config(tmp_path / "best.json", run_config(ranked[0], pooled.meta))
    read = read_run_config(tmp_path / "best.json")
    assert {"cxl_budget", "cxl_policy"} <= set(read) and "mode" not in read
    tiers = build(RunConfig, nest(RunConfig, read | {"synthetic_tokens": 100})).tiers
    assert (tiers.cxl_budget, tiers.cxl_policy) == (read["cxl_budget"], read["cxl_policy"])
    sparse = TraceMeta(block_bytes=MiB, tiers=base.meta.tiers, layers=2, info={"engine": "sparse"})
    assert run_config(ranked[0], sparse)["mode"] == "sparse"


@pytest.mark.parametrize("meta,message", [
    (dict(block_bytes=True), "block_bytes=True: must be a positive integer"),
    (dict(tiers=(TierSpec("gpu", "gpu", 2), TierSpec("gpu", "cpu", 2))), "each tier needs a name of its own"),
    (dict(tiers=(TierSpec("gpu", "teleport", 2),)), "tier medium 'teleport': allowed: cpu, cxl, gpu, nvme"),
    (dict(tiers=(TierSpec("gpu", "gpu", 10**30),)), "each with 1 to 1099511627776 slots"),
])
def test_a_header_of_no_run_is_refused_by_name(meta: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TraceMeta(**{"block_bytes": MiB, "tiers": (TierSpec("gpu", "gpu", 2),)} | meta)


def test_a_dense_trace_config_names_the_prefetch_tierkv_run_takes(trace: AccessTrace, model: TierModel) -> None:
    ranked = tune(trace, model, parse_grid(["prefetch=none"], trace.meta, ["lru"]))
    config = run_config(ranked[0], trace.meta)
    assert config["prefetch"] == "none" and "sparse_prefetch" not in config
    assert config["tuned"]["prefetch"] == "none"
    default = run_config(tune(trace, model, parse_grid([], trace.meta, ["lru"]))[0], trace.meta)
    assert default["prefetch"] == "next-layer"   # not varied: the dense engine's own default


def test_no_successful_setting_means_no_config(trace: AccessTrace) -> None:
    with pytest.raises(ConfigError, match="no setting replayed without error"):
        run_config(Ranked({"policy": "lru"}, error="BudgetExceeded: x"), trace.meta)


def test_a_run_config_may_name_a_sparse_prefetch(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"format": "tierkv-run-config", "version": 1, "sparse_prefetch": "speculative"}')
    assert read_run_config(path) == {"sparse_prefetch": "speculative"}


@pytest.mark.parametrize("content,message", [
    ("{", "not JSON"),
    ('{"format": "other", "version": 1}', r"not a tierkv-run-config file \(format 'other'\)"),
    ("[1]", r"not a tierkv-run-config file \(a JSON list\)"),
    ('{"format": "tierkv-run-config", "version": 2}', "tierkv-run-config version 2; this tierkv reads version 1"),
    ('{"format": "tierkv-run-config", "version": true}', "version True"),
    ('{"format": "tierkv-run-config", "version": 1, "gpu_budgett": "1GiB"}', r"unknown keys \['gpu_budgett'\]"),
    ('{"format": "tierkv-run-config", "version": 1, "cpu_budget": "many"}', "cpu_budget='many'"),
    ('{"format": "tierkv-run-config", "version": 1, "gpu_policy": 3}', "gpu_policy=3: expected a name"),
])
def test_bad_run_configs_are_one_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_run_config(path)
    with pytest.raises(ConfigError, match="cannot read the run config"):
        read_run_config(tmp_path / "missing.json")


# -- the tier model -------------------------------------------------------------------
def test_a_probe_becomes_a_tier_model_with_one_disk_channel() -> None:
    link = {"latency_us": 10.0, "queue_depth": 1, "request_bytes": 1, "how": "x"}
    probe = {"links": {"cpu->cpu": link | {"gbps": 12.0}, "cpu->gpu": link | {"gbps": 20.0},
                       "gpu->cpu": link | {"gbps": 18.0}, "nvme->cpu": link | {"gbps": 2.0, "queue_depth": 8},
                       "cpu->nvme": link | {"gbps": 1.5, "queue_depth": 8}}}
    model = tier_model_from_probe(probe)
    assert model.link("nvme", "gpu").gbps == 2.0 and model.link("nvme", "cpu").queue_depth == 8
    assert model.link("gpu", "nvme").gbps == 18.0 and model.link("cpu", "nvme").gbps == 1.5
    assert model.link("nvme", "cpu").channel == model.link("cpu", "nvme").channel == "nvme"
    assert model.link("new", "gpu").gbps == 20.0 and model.link("new", "cpu").gbps == 12.0


def test_without_links_the_model_comes_from_this_machine_probe(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv.profile import probe
    monkeypatch.setattr(probe, "QUICK", probe.ProbeSize(2**20, 2**20, 2**16, 2, 4, 0.0))
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    model = tune_module.load_tier_model(None, None)
    measured = json.loads((tmp_path / "probe.json").read_text())["results"][str(tmp_path.resolve())]
    assert model.link("nvme", "cpu").gbps == measured["links"]["nvme->cpu"]["gbps"] > 0
    assert model.link("cpu", "gpu").gbps == measured["links"]["cpu->gpu"]["gbps"]


# -- the command ------------------------------------------------------------------------
def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tierkv")
    add_tune(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_tune_prints_a_table_writes_the_best_config_and_a_plot(trace: AccessTrace, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace.write(tmp_path / "run.tkv")
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    argv = ["tune", str(tmp_path / "run.tkv"), "--policies", "lru,arc", "--grid", "gpu_budget=1MiB,8MiB",
            "--links", str(tmp_path / "links.json"), "--plot", str(tmp_path / "rank.png")]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["rank", "gpu_budget", "policy"] and len(lines[1:5]) == 4
    assert "8MiB" in lines[1]
    assert f"tierkv run --config {tmp_path / 'run.best.json'}" in out
    assert read_run_config(tmp_path / "run.best.json")["gpu_budget"] == "8MiB"
    assert (tmp_path / "rank.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags,message", [
    (["--plot", "{d}/rank.txt"], "--plot {d}/rank.txt: give a file name ending in a format matplotlib writes: "),
    (["--plot", "{d}/no/rank.png"], "--plot {d}/no/rank.png: no such directory {d}/no"),
    (["--out", "{d}/no/best.json"], "--out {d}/no/best.json: no such directory {d}/no"),
    (["--policies", ","], "--policies ',': names no policy; give names such as lru,arc"),    # (was an IndexError)
])
def test_tune_refuses_a_plot_or_an_out_it_cannot_write_before_it_replays_and_writes_nothing(
        flags: list[str], message: str, trace: AccessTrace, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace.write(tmp_path / "run.tkv")
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    argv = ["tune", str(tmp_path / "run.tkv"), "--policies", "lru", "--links", str(tmp_path / "links.json"),
            *[f.format(d=tmp_path) for f in flags]]
    with pytest.raises(ConfigError, match=re.escape(message.format(d=tmp_path))):
        _run(argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["links.json", "run.tkv"]   # no run.best.json


def test_tune_json_is_one_object_with_the_ranking(trace: AccessTrace, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    trace.write(tmp_path / "run.tkv")
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    assert _run(["tune", str(tmp_path / "run.tkv"), "--policies", "lru", "--links", str(tmp_path / "links.json"),
                 "--json", "--out", str(tmp_path / "best.json")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["best_config"] == str(tmp_path / "best.json")
    assert [r["setting"] for r in report["ranking"]] == [{"policy": "lru"}]
    assert report["ranking"][0]["result"]["stall_s"] >= 0
    assert report["model"]["links"]["nvme->*"]["channel"] == "nvme"


def test_prefetch_is_short_for_a_grid_of_prefetchers(trace: AccessTrace, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    trace.write(tmp_path / "run.tkv")
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    argv = ["tune", str(tmp_path / "run.tkv"), "--policies", "lru", "--links", str(tmp_path / "links.json"), "--json"]
    assert _run([*argv, "--prefetch", "none,next-layer"]) == 0
    settings = [r["setting"] for r in json.loads(capsys.readouterr().out)["ranking"]]
    assert sorted(s["prefetch"] for s in settings) == ["next-layer", "none"]
    with pytest.raises(ConfigError, match="--prefetch and --grid prefetch=: name the prefetchers once"):
        _run([*argv, "--prefetch", "none", "--grid", "prefetch=next-layer"])


def test_tune_errors_name_the_problem(trace: AccessTrace, tmp_path: Path) -> None:
    trace.write(tmp_path / "run.tkv")
    with pytest.raises(ConfigError, match="--links .*missing.json: cannot read"):
        _run(["tune", str(tmp_path / "run.tkv"), "--policies", "lru", "--links", str(tmp_path / "missing.json")])
    with pytest.raises(ConfigError, match="--top=0"):
        _run(["tune", str(tmp_path / "run.tkv"), "--top", "0"])
    with pytest.raises(ConfigError, match="cannot read the access trace"):
        _run(["tune", str(tmp_path / "nothing.tkv")])


def test_the_example_tunes_a_policy_from_its_own_file(monkeypatch: pytest.MonkeyPatch) -> None:
    examples = Path(__file__).parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    example = __import__("tune_my_policy")
    trace = example.decode_trace(steps=2)  # 64 blocks: the loop overflows gpu + cpu (24)
    ranked = tune(trace, TierModel.from_dict(example.HAND_MODEL),
                  parse_grid(["prefetch=none"], trace.meta, ["lru", example.MY_POLICY]))
    assert [r.point["policy"] for r in ranked] == [example.MY_POLICY, "lru"]  # a loop: MRU keeps part of it
    assert ranked[0].result.hit_rates["gpu"] > ranked[1].result.hit_rates["gpu"]
