"""The import graph keeps the architecture's direction: nothing imports a layer above it, and no cycles.

Layers, bottom to top (docs/architecture.md draws them)::

    0  errors keys keytable device events sizes knobs ...     what everything shares
    1  tiers                                                   bytes and their I/O
    2  policies                                                rank keys; bottom imports only
    3  config                                                  typed settings of the tiers
    4  profile                                                 traces, summaries, access traces, probes
    5  manager                                                 directory, orchestration, the blocking facade
    6  sparse                                                  ShadowKV index, selection, the sparse step
    7  model schedule hf                                       engines, batch schedule, transformers' Cache
    8  tune session                                            tuning over access traces; the library API
    9  cli info serve                                          the commands, the HTTP server
   10  tierkv                                                  the package itself: the API's names

A module may import its own layer and those below; ``policies`` only the bottom. Imports under
``if TYPE_CHECKING:`` are for annotations and do not count.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import tierkv

ROOT = Path(tierkv.__file__).parent.parent
LAYERS: dict[str, int] = {
    **dict.fromkeys(["tierkv.errors", "tierkv.keys", "tierkv.keytable", "tierkv.device", "tierkv.events", "tierkv.sizes",
                     "tierkv.knobs", "tierkv.scoring", "tierkv.policy", "tierkv.codec", "tierkv.layout", "tierkv.ops",
                     "tierkv.failpoints", "tierkv.flags"], 0),
    "tierkv.tiers": 1, "policies": 2, "tierkv.config": 3, "tierkv.profile": 4, "tierkv.manager": 5,
    "tierkv.sparse": 6, "tierkv.model": 7, "tierkv.schedule": 7, "tierkv.hf": 7, "tierkv.tune": 8,
    "tierkv.session": 8, "tierkv.cli": 9, "tierkv.info": 9, "tierkv.serve": 9,
    "tierkv": 10,     # the package's face: names the API, imported on first use
}
ONLY_BOTTOM = {"policies"}  # layers that may import nothing from tierkv but layer 0


def layer_of(module: str) -> tuple[str, int]:
    """The longest entry of LAYERS that names ``module`` or a package above it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return name, LAYERS[name]
    raise AssertionError(f"{module}: in no layer; add it to LAYERS (and to docs/architecture.md)")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imports_of(path: Path) -> Iterator[str]:
    """Every project module ``path`` imports, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{alias.name}" if _is_module(f"{module}.{alias.name}") else module
                     for alias in node.names]
        else:
            continue
        yield from (name for name in names if name.split(".")[0] in ("tierkv", "policies"))


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    paths = [*ROOT.joinpath("tierkv").rglob("*.py"), *ROOT.joinpath("policies").rglob("*.py")]
    return {module_name(path): set(imports_of(path)) for path in paths}


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        name, rank = layer_of(module)
        for target in sorted(targets):
            target_name, target_rank = layer_of(target)
            if target_rank > rank or (name in ONLY_BOTTOM and target_name != name and target_rank > 0):
                found.append(f"{module} (layer {rank}, {name}) imports {target} (layer {target_rank}, {target_name})")
    return found


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), package __init__ edges left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def edges(module: str) -> Iterator[str]:
        # A package's __init__ re-exporting its own modules is how packages are built, not a cycle.
        return (t for t in graph.get(module, ()) if t in graph and not module.startswith(t + "."))

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges(module):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                found.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_a_layer_above_it():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_module_has_a_layer():
    unplaced = []
    for module in import_graph():
        try:
            layer_of(module)
        except AssertionError as missing:
            unplaced.append(str(missing))
    assert unplaced == []


def test_the_checks_catch_what_they_guard():
    graph = {"tierkv.tiers.nvme": {"tierkv.config"}, "tierkv.config": {"tierkv.tiers.cxl_link"},
             "policies.lru": {"tierkv.tiers.base"}, "tierkv.manager.manager": {"tierkv.tune.replay"},
             "tierkv.tune.replay": {"tierkv.manager.manager"}, "tierkv.tiers.cxl_link": set()}
    upward = upward_imports(graph)
    assert [line.split(" ")[0] for line in upward] == ["policies.lru", "tierkv.manager.manager", "tierkv.tiers.nvme"]
    assert cycles({"tierkv.a": {"tierkv.b"}, "tierkv.b": {"tierkv.a"}, "tierkv.c": {"tierkv.a"}}) == [
        ["tierkv.a", "tierkv.b"]]
