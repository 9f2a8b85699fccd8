"""tierkv run --config / --*-policy / --prefetch, tierkv info --probe, and tierkv tune registered."""
import json

import pytest

from tierkv.cli import build_parser, main, run_config


def settings_of(*argv: str):
    """The RunConfig ``tierkv run ARGV`` would run with."""
    return run_config(build_parser().parse_args(["run", *argv]))[0]


def write_config(path, **values) -> str:
    path.write_text(json.dumps({"format": "tierkv-run-config", "version": 1, **values}))
    return str(path)


def test_run_config_file_then_flags(tmp_path):
    best = write_config(tmp_path / "best.json", gpu_budget="64MiB", cpu_policy="arc", prefetch="next-layer-all",
                        tuned={"x": 1})
    config = settings_of("--synthetic-tokens", "100", "--config", best, "--cpu-budget", "2GiB")
    tiers, engine = config.tiers, config.engine
    assert (tiers.gpu_budget, tiers.cpu_budget, tiers.nvme_budget) == ("64MiB", "2GiB", "64GiB")
    assert (tiers.gpu_policy, tiers.cpu_policy, engine.prefetch) == ("lru", "arc", "next-layer-all")


def test_a_sparse_run_config_file_sets_the_sparse_prefetcher(tmp_path):
    best = write_config(tmp_path / "best.json", sparse_prefetch="speculative")
    config = settings_of("--synthetic-tokens", "100", "--mode", "sparse", "--config", best)
    assert config.sparse.prefetch == "speculative" and config.engine.prefetch == "next-layer"


def test_a_run_config_file_s_prefetcher_counts_as_given_for_the_mode(tmp_path):
    """A config tuned on a sparse run names its prefetcher: a dense run refuses it, an auto one that runs
    dense says it went unused (it used to run dense and say nothing)."""
    from tierkv.errors import ConfigError
    best = write_config(tmp_path / "best.json", sparse_prefetch="speculative")
    with pytest.raises(ConfigError, match=r"--sparse-prefetch \(in --config .*best.json\): sparse-mode settings, "
                                          "but --mode dense"):
        settings_of("--synthetic-tokens", "100", "--mode", "dense", "--config", best)
    args = build_parser().parse_args(["run", "--synthetic-tokens", "100", "--config", best])
    assert run_config(args)[1] == [f"--sparse-prefetch (in --config {best})"]     # noted where auto runs dense


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


def test_a_sparse_run_takes_a_prefill_chunk_that_is_no_multiple_of_the_dense_block():
    """--block-tokens is dense mode's: a sparse run neither takes it nor checks its chunk against it."""
    assert settings_of("--synthetic-tokens", "100", "--mode", "sparse", "--chunk-tokens", "128").engine.chunk_tokens \
        == 128
    with pytest.raises(Exception, match="must be a multiple of block_tokens=256"):
        settings_of("--synthetic-tokens", "100", "--mode", "auto", "--chunk-tokens", "128")
