import json

import pytest

from tierkv.errors import ConfigError
from tierkv.schedule.policy import Placement, Policy, read_policy, write_policy


def test_placement_must_sum_to_one_and_stay_in_range():
    with pytest.raises(ConfigError, match="sum to 1"):
        Placement(0.5, 0.2, 0.2)
    with pytest.raises(ConfigError, match=r"disk=-0.5: must be in \[0, 1\]"):
        Placement(1.0, 0.5, -0.5)
    with pytest.raises(ConfigError, match="expected a number"):
        Placement("all", 0, 0)


def test_split_gives_the_first_items_to_the_fastest_tier():
    assert Placement(0.25, 0.5, 0.25).split(8) == (2, 4, 2)
    assert Placement(0.0, 1.0, 0.0).split(5) == (0, 5, 0)
    assert Placement(0.3, 0.3, 0.4).split(3) == (0, 1, 2)
    assert sum(Placement(0.1, 0.6, 0.3).split(17)) == 17


def test_home_is_where_the_midpoint_falls():
    p = Placement(0.2, 0.5, 0.3)
    assert [p.home(a, b) for a, b in ((0, 0.1), (0.1, 0.35), (0.5, 0.7), (0.6, 1.0))] == ["gpu", "cpu", "cpu", "disk"]


def test_policy_validates_its_fields():
    with pytest.raises(ConfigError, match="gpu_batch_size=0"):
        Policy(0, 1)
    with pytest.raises(ConfigError, match="num_gpu_batches=True"):
        Policy(4, True)
    with pytest.raises(ConfigError, match="overlap"):
        Policy(4, 2, overlap="yes")
    with pytest.raises(ConfigError, match="weight_dtype='int8': allowed: bfloat16, float16 or none"):
        Policy(4, 2, weight_dtype="int8")
    assert Policy(4, 3).block_size == 12


def test_policy_file_round_trip_and_errors(tmp_path):
    policy = Policy(8, 4, weights=Placement(0, 0.5, 0.5), kv=Placement(0.25, 0.75, 0), compress_kv=True)
    path = tmp_path / "p.json"
    write_policy(policy, path)
    assert read_policy(path) == policy
    bf16 = Policy(8, 4, weights=Placement(0, 1, 0), weight_dtype="bfloat16")
    write_policy(bf16, path)
    assert read_policy(path) == bf16 and "bfloat16-weights" in bf16.describe()
    path.write_text(json.dumps({"gpu_batch_size": 2, "num_gpu_batches": 1}))
    assert read_policy(path).weight_dtype is None                       # older files: the compute dtype
    path.write_text(json.dumps({"gpu_batch_size": 2, "num_gpu_batches": 1, "weight_dtype": "fp8"}))
    with pytest.raises(ConfigError, match="weight_dtype='fp8': allowed"):
        read_policy(path)
    path.write_text(json.dumps({"gpu_batch_size": 2, "num_gpu_batches": 1, "weight": {}}))
    with pytest.raises(ConfigError, match="unknown key.*weight"):
        read_policy(path)
    for version in (2, "1", True):                                      # a later tierkv's, or no number
        path.write_text(json.dumps({"version": version, "gpu_batch_size": 2, "num_gpu_batches": 1}))
        with pytest.raises(ConfigError, match=f"policy version={version!r}: this tierkv reads version 1"):
            read_policy(path)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not a readable JSON policy"):
        read_policy(path)
    with pytest.raises(ConfigError, match="no such file"):
        read_policy(tmp_path / "missing.json")
