"""Policies by name: the registry, ``module:Class`` loading, and what ``policies`` may import."""
from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import policies
from policies import available, make_policy, register
from policies import registry as registry_module
from tierkv.errors import ConfigError
from tierkv.policy import EvictionPolicy

BUILT_IN = ["arc", "fifo", "h2o", "lfu", "lfu-history", "lru", "s3fifo", "streaming"]
POLICIES_DIR = Path(policies.__file__).parent
ALLOWED_OUTSIDE_STDLIB = {"tierkv.policy", "tierkv.errors", "policies"}
# Chunk selectors score tensors (torch, the shared scoring math). They are imported on their own, never by
# ``import policies``; the near-memory one is the CXL tier's (tierkv.tiers.cxl_select), named by path.
TENSOR_POLICIES = {
    "selectors.py": {"torch", "tierkv.scoring"},
}

CUSTOM = '''
from collections import OrderedDict


class NewestFirst:
    """Evicts the most recently inserted key first."""

    def __init__(self, capacity=None, tag="plain"):
        self.capacity, self.tag, self.keys = capacity, tag, OrderedDict()

    def insert(self, key):
        self.keys[key] = None

    def touch(self, key):
        pass

    def remove(self, key):
        self.keys.pop(key, None)

    def evict(self, n, protected):
        found = [key for key in reversed(self.keys) if key not in protected][:n]
        if len(found) < n:
            return None
        for key in found:
            del self.keys[key]
        return found

    def __len__(self):
        return len(self.keys)


class InsertOnly:
    def insert(self, key):
        pass


NOT_A_CLASS = 42
'''


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path; modules imported from it are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", "") or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module.EVICTION, "_factories", dict(registry_module.EVICTION._factories))


def test_available_lists_the_built_ins_sorted() -> None:
    assert available() == BUILT_IN


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_call_builds_a_fresh_policy(name: str) -> None:
    first, second = make_policy(name), make_policy(name)
    assert isinstance(first, EvictionPolicy) and first is not second
    first.insert("a")
    assert len(second) == 0


def test_an_unknown_name_lists_every_valid_one() -> None:
    with pytest.raises(ConfigError) as caught:
        make_policy("mru")
    message = str(caught.value)
    assert "'mru'" in message and "module:Class" in message
    for name in BUILT_IN:
        assert name in message


def test_parameters_a_policy_does_not_take_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="colour"):
        make_policy("lru", colour="red")


def test_parameter_values_are_validated_by_the_policy() -> None:
    with pytest.raises(ConfigError, match=r"small_ratio=1\.5"):
        make_policy("s3fifo", small_ratio=1.5)


def test_a_custom_policy_loads_from_module_colon_class(module_dir: Path) -> None:
    (module_dir / "custom_cache.py").write_text(CUSTOM)
    policy = make_policy("custom_cache:NewestFirst", capacity=3, tag="mine")
    from custom_cache import NewestFirst  # type: ignore[import-not-found]

    assert isinstance(policy, NewestFirst) and isinstance(policy, EvictionPolicy)
    assert (vars(policy)["capacity"], vars(policy)["tag"]) == (3, "mine")
    for key in "abc":
        policy.insert(key)
    assert policy.evict(2, frozenset("c")) == ["b", "a"]


def test_a_custom_policy_loads_from_a_dotted_module(module_dir: Path) -> None:
    package = module_dir / "cachepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "strategies.py").write_text(CUSTOM)
    assert len(make_policy("cachepkg.strategies:NewestFirst")) == 0


def test_a_missing_module_is_named(module_dir: Path) -> None:
    with pytest.raises(ConfigError, match="cannot import module 'no_such_cache_module'"):
        make_policy("no_such_cache_module:Policy")


def test_a_missing_class_is_named(module_dir: Path) -> None:
    (module_dir / "custom_missing.py").write_text(CUSTOM)
    with pytest.raises(ConfigError, match="'custom_missing' has no attribute 'Nope'"):
        make_policy("custom_missing:Nope")


def test_a_class_that_is_not_a_policy_names_what_it_lacks(module_dir: Path) -> None:
    (module_dir / "custom_partial.py").write_text(CUSTOM)
    with pytest.raises(ConfigError) as caught:
        make_policy("custom_partial:InsertOnly")
    assert "InsertOnly does not implement EvictionPolicy (missing: touch, remove, evict, __len__)" in str(caught.value)


def test_an_attribute_that_is_not_a_class_is_rejected(module_dir: Path) -> None:
    (module_dir / "custom_constant.py").write_text(CUSTOM)
    with pytest.raises(ConfigError, match="'NOT_A_CLASS' is a int, not a class"):
        make_policy("custom_constant:NOT_A_CLASS")
    (module_dir / "custom_call.py").write_text("CALLED = []\ndef act():\n    CALLED.append(1)\n")
    with pytest.raises(ConfigError, match="'act' is a function, not a class"):    # named in a file: never called
        make_policy("custom_call:act")
    import custom_call
    assert custom_call.CALLED == []


@pytest.mark.parametrize("spec", [":NewestFirst", "custom_cache:", ":"])
def test_a_malformed_module_class_spec_says_what_is_expected(spec: str) -> None:
    with pytest.raises(ConfigError, match="expected 'module:Class'"):
        make_policy(spec)


def test_register_adds_a_name(scratch_registry: None, module_dir: Path) -> None:
    (module_dir / "custom_registered.py").write_text(CUSTOM)
    from custom_registered import NewestFirst  # type: ignore[import-not-found]

    register("newest")(NewestFirst)
    assert "newest" in available()
    assert isinstance(make_policy("newest"), NewestFirst)


def test_register_refuses_a_taken_name(scratch_registry: None) -> None:
    with pytest.raises(ConfigError, match="'lru': already registered"):
        register("lru")(type(make_policy("fifo")))


@pytest.mark.parametrize("name", ["", "a:b"])
def test_register_refuses_names_that_clash_with_module_class(scratch_registry: None, name: str) -> None:
    with pytest.raises(ConfigError, match="without ':'"):
        register(name)


def _imported_modules(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: use absolute imports"
            yield node.module or ""


@pytest.mark.parametrize("path", sorted(POLICIES_DIR.glob("*.py")), ids=lambda p: p.name)
def test_policies_import_only_the_stdlib_and_the_policy_protocol(path: Path) -> None:
    for module in _imported_modules(path):
        top = module.split(".")[0]
        allowed = top in sys.stdlib_module_names or top == "policies" or module in ALLOWED_OUTSIDE_STDLIB \
            or module in TENSOR_POLICIES.get(path.name, ())
        assert allowed, f"{path.name} imports {module}"


def test_importing_policies_loads_neither_torch_nor_numpy() -> None:
    code = "import sys, policies; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=POLICIES_DIR.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
