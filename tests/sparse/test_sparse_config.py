import pytest

from tierkv.errors import ConfigError
from tierkv.sparse.config import SparseConfig, parse_budget


@pytest.mark.parametrize("text, expected", [("2048", 2048), (512, 512), ("2%", 0.02), ("1.5 %", 0.015),
                                            (0.25, 0.25), ("100%", 1.0), ("0", 0)])
def test_budget_is_tokens_or_a_share(text, expected):
    assert parse_budget(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["lots", "-5", "0%", "100.5%", "150%", 1.5, True, "2048 tokens"])
def test_bad_budget_names_what_is_allowed(bad):
    with pytest.raises(ConfigError, match=r"sparse_budget=.*(tokens|share)"):
        SparseConfig(budget=bad)


@pytest.mark.parametrize("field, value, name", [("budget", 5, "sparse_budget=5"), ("prefill_budget", "7", "prefill_budget=7"),
                                               ("layer_budgets", "3:1", r"layer_budgets\[3\]=1")])
def test_a_budget_under_one_chunk_is_refused_as_selecting_nothing(field, value, name):
    with pytest.raises(ConfigError, match=name + ": less than one chunk of 8 tokens.*at least 8, or 0"):
        SparseConfig(**{field: value})


def test_a_share_of_all_selects_every_chunk():
    assert SparseConfig(budget="100%").budget_tokens(4000) == 4000


def test_budget_tokens_are_whole_chunks():
    assert SparseConfig(budget=2048).budget_tokens(10**6) == 2048
    assert SparseConfig(budget="2%").budget_tokens(100_000) == 2000
    assert SparseConfig(budget=100).budget_tokens(10**6) == 96     # 12 chunks of 8


@pytest.mark.parametrize("dims, rank", [(1024, 160), (192, 192), (4096, 640), (512, 128), (32, 32)])
def test_default_rank_scales_with_the_key_width(dims, rank):
    assert SparseConfig().key_rank(dims) == rank


def test_explicit_rank_must_fit_the_keys():
    assert SparseConfig(rank=192).key_rank(192) == 192
    with pytest.raises(ConfigError, match="rank=200: at most the key dimensions Hkv\\*D=192"):
        SparseConfig(rank=200).key_rank(192)


@pytest.mark.parametrize("field, value, message", [
    ("page_tokens", 12, "multiple of the tokens one landmark summarises .*chunk_tokens, 8; not --chunk-tokens"),
    ("sink_tokens", 4, "multiple of the sparse chunk_tokens, 8"),
    ("chunk_tokens", 0, "must be > 0"), ("window_tokens", -1, "must be >= 0"),
    ("outlier_fraction", 1.0, r"in \[0, 1\)"), ("rank", 0, "must be > 0"),
    ("positions", "rope", "allowed: auto, original, remap"), ("selector", "best", "valid names: .*quest, shadowkv"),
    ("prefetch", "eager", "valid names: none, previous-step, speculative"),
    ("attend", "heads", "allowed: pages, chunks"),
])
def test_each_field_is_checked(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SparseConfig(**{field: value})


def test_resolve_within_and_past_the_trained_window():
    within = SparseConfig().resolve(prompt_tokens=6000, trained_tokens=8192)
    assert (within.positions, within.dense_prefill_tokens) == ("original", 6000)
    past = SparseConfig().resolve(prompt_tokens=100_000, trained_tokens=8192)
    assert (past.positions, past.dense_prefill_tokens) == ("remap", 4096)
    forced = SparseConfig(positions="original", dense_prefill_tokens=0).resolve(prompt_tokens=10**6,
                                                                                trained_tokens=8192)
    assert (forced.positions, forced.dense_prefill_tokens) == ("original", 0)


def test_a_layer_can_have_its_own_decode_budget():
    c = SparseConfig(budget=2048, layer_budgets="0:6144; 3:5%")
    assert c.layer_budgets == ((0, 6144), (3, 0.05))
    assert SparseConfig(layer_budgets={3: 0.05, 0: 6144}) == c
    assert c.budget_tokens(16384, layer=0) == 6144 and c.budget_tokens(16384, layer=3) == 816
    assert c.budget_tokens(16384, layer=1) == c.budget_tokens(16384) == 2048
    assert c.budget_tokens(16384, prefill=True, layer=0) == 1024       # prefill chunks keep their own budget


@pytest.mark.parametrize("bad, message", [("0=6144", "LAYER:BUDGET pairs"), ("x:1", "LAYER:BUDGET pairs"),
                                          ("0:1;0:2", "at most once"), ("0:lots", r"layer_budgets\[0\]")])
def test_bad_layer_budgets_name_what_is_allowed(bad, message):
    with pytest.raises(ConfigError, match=message):
        SparseConfig(layer_budgets=bad)
