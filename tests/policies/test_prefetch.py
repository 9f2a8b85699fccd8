"""Prefetch strategies: what each plans, and the registry's loud errors."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.prefetch import make_prefetch, prefetch_policies, register_prefetch
from tierkv.errors import ConfigError
from tierkv.policy import ObservesSelection, PrefetchPolicy

BLOCKS = [f"b{i}" for i in range(8)]


def test_the_built_ins_are_listed_sorted() -> None:
    assert prefetch_policies() == ["next-layer", "next-layer-all", "none", "previous-layer",
                                   "previous-step", "streaming"]
    for name in prefetch_policies():
        assert isinstance(make_prefetch(name), PrefetchPolicy)


@pytest.mark.parametrize("name,planned", [
    ("none", []),
    ("next-layer", ["b0", "b1", "b2"]),
    ("next-layer-all", BLOCKS),
    ("streaming", ["b0", "b7"]),
    ("previous-step", ["b0", "b1", "b2"]),   # nothing selected yet: like next-layer
    ("previous-layer", ["b0", "b1", "b2"]),
])
def test_plans_on_a_layer_of_eight_blocks_with_depth_three(name: str, planned: list[str]) -> None:
    assert make_prefetch(name).plan(4, BLOCKS, 3) == planned


def test_streaming_plans_sinks_then_window_without_duplicates_within_depth() -> None:
    plan = make_prefetch("streaming", sinks=2, window=3).plan
    assert plan(1, BLOCKS, 10) == ["b0", "b1", "b5", "b6", "b7"]
    assert plan(1, BLOCKS, 3) == ["b0", "b1", "b5"]
    assert plan(1, BLOCKS[:4], 10) == ["b0", "b1", "b2", "b3"]
    assert plan(1, [], 10) == []


def test_previous_step_reuses_what_the_same_layer_selected() -> None:
    prefetch = make_prefetch("previous-step")
    assert isinstance(prefetch, ObservesSelection)
    prefetch.selected(4, [6, 2, 99])              # indices past the layer's end are dropped
    prefetch.selected(3, [1])
    assert prefetch.plan(4, BLOCKS, 8) == ["b6", "b2"]
    assert prefetch.plan(4, BLOCKS, 1) == ["b6"]
    assert prefetch.plan(5, BLOCKS, 2) == ["b0", "b1"]


def test_previous_layer_guesses_from_the_layer_before() -> None:
    prefetch = make_prefetch("previous-layer")
    prefetch.selected(3, [5, 0])
    assert prefetch.plan(4, BLOCKS, 8) == ["b5", "b0"]
    assert prefetch.plan(0, BLOCKS, 2) == ["b0", "b1"]


@pytest.mark.parametrize("name", ["none", "next-layer", "streaming", "previous-step"])
def test_negative_depth_is_an_error(name: str) -> None:
    with pytest.raises(ValueError, match="depth=-1"):
        make_prefetch(name).plan(0, BLOCKS, -1)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"prefetch='nextlayer': unknown; valid names: next-layer, "):
        make_prefetch("nextlayer")


def test_bad_parameters_and_counts_name_the_field() -> None:
    with pytest.raises(ConfigError, match="do not fit"):
        make_prefetch("next-layer", depth=3)
    with pytest.raises(ConfigError, match="window=-2"):
        make_prefetch("streaming", window=-2)


def test_names_are_unique_and_cannot_hold_a_colon() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_prefetch("none")(object)
    with pytest.raises(ConfigError, match="reserved for module:Class"):
        register_prefetch("a:b")


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n, m in sys.modules.items() if str(getattr(m, "__file__", "") or "").startswith(str(tmp_path))]:
        del sys.modules[name]


def test_a_custom_strategy_loads_by_module_and_class(module_dir: Path) -> None:
    (module_dir / "my_prefetch.py").write_text(
        "class LastTwo:\n"
        "    def __init__(self, n=2):\n"
        "        self.n = n\n"
        "    def plan(self, layer, blocks, depth):\n"
        "        return list(blocks[-self.n:])[:depth]\n"
        "class Nothing:\n"
        "    pass\n")
    assert make_prefetch("my_prefetch:LastTwo", n=3).plan(0, BLOCKS, 8) == ["b5", "b6", "b7"]
    with pytest.raises(ConfigError, match=r"Nothing does not implement PrefetchPolicy \(missing: plan\)"):
        make_prefetch("my_prefetch:Nothing")
    with pytest.raises(ConfigError, match="cannot import module"):
        make_prefetch("no_such_module_here:X")


# -- sparse prefetchers ----------------------------------------------------------------------
def test_sparse_prefetchers_are_listed() -> None:
    from policies.selectors import sparse_prefetchers
    assert sparse_prefetchers() == ["none", "previous-step", "speculative"]


def test_speculative_stops_guessing_a_layer_whose_guesses_miss_and_resumes_when_they_hit() -> None:
    import torch

    from policies.selectors import make_sparse_prefetch
    spec = make_sparse_prefetch("speculative")
    good, bad = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27]])
    assert torch.equal(spec.plan(3, good, None), good)          # no record yet: guess
    assert spec.plan(3, good, bad) is None and spec.recall[3] == 0.0   # the layer chose none of the guess
    assert spec.plan(3, good, torch.tensor([[1, 2, 3, 4], [5, 6, 7, 9]])) is None   # (0 + 7/8) / 2 < 0.5
    assert spec.recall[3] == pytest.approx(7 / 16)
    assert torch.equal(spec.plan(3, good, good), good)          # (7/16 + 1) / 2 >= 0.5: guessing again
    assert torch.equal(spec.plan(4, bad, None), bad)            # layers are judged apart
    always = make_sparse_prefetch("speculative", min_recall=0.0)
    always.plan(3, good, None)
    assert torch.equal(always.plan(3, good, bad), good)         # min_recall=0: every guess is loaded
