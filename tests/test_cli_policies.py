"""tierkv run --config / --*-policy / --prefetch, tierkv info --probe, and tierkv tune registered."""
import json

import pytest

from tierkv.cli import main


def test_run_config_file_then_flags(tmp_path, monkeypatch):
    seen = {}

    def run(config, **kw):
        seen["c"] = config
        raise SystemExit(0)

    monkeypatch.setattr("tierkv.model.generate.run", run)
    (tmp_path / "best.json").write_text(json.dumps({"format": "tierkv-run-config", "version": 1,
        "gpu_budget": "64MiB", "cpu_policy": "arc", "prefetch": "next-layer-all", "tuned": {"x": 1}}))
    with pytest.raises(SystemExit):
        main(["run", "--synthetic-tokens", "100", "--config", str(tmp_path / "best.json"), "--cpu-budget", "2GiB"])
    tiers, engine = seen["c"].tiers, seen["c"].engine
    assert (tiers.gpu_budget, tiers.cpu_budget, tiers.nvme_budget) == ("64MiB", "2GiB", "64GiB")
    assert (tiers.gpu_policy, tiers.cpu_policy, engine.prefetch) == ("lru", "arc", "next-layer-all")


def test_a_sparse_run_config_file_sets_the_sparse_prefetcher(tmp_path, monkeypatch):
    seen = {}

    def run(config, **kw):
        seen["c"] = config
        raise SystemExit(0)

    monkeypatch.setattr("tierkv.model.generate.run", run)
    (tmp_path / "best.json").write_text(json.dumps({"format": "tierkv-run-config", "version": 1,
                                                    "sparse_prefetch": "speculative"}))
    with pytest.raises(SystemExit):
        main(["run", "--synthetic-tokens", "100", "--mode", "sparse", "--config", str(tmp_path / "best.json")])
    assert seen["c"].sparse.prefetch == "speculative" and seen["c"].engine.prefetch == "next-layer"


@pytest.mark.parametrize("args,message", [
    (["run", "--synthetic-tokens", "100", "--gpu-policy", "mru"], "policy='mru': unknown"),
    (["run", "--synthetic-tokens", "100", "--prefetch", "eager"], "prefetch='eager': unknown"),
    (["run", "--synthetic-tokens", "100", "--config", "/nope.json"], "cannot read the run config"),
])
def test_bad_run_flags_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_info_probe(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path))
    assert main(["info", "--probe", "--nvme-dir", str(tmp_path / "kv")]) == 0
    out = capsys.readouterr().out
    assert "nvme->cpu" in out and "GB/s" in out
    assert main(["info", "--probe", "--json"]) == 0
    assert "cpu->gpu" in json.loads(capsys.readouterr().out)["links"]["links"]


def test_tune_is_a_command(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    assert "--grid" in capsys.readouterr().out
