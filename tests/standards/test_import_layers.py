"""The import graph of `miles/`: no cycles between files, no import up across the layers that
docs/architecture.md draws (its `## Layers` table is read here, so the page and the check agree).

Every import counts: module level, inside functions, and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "miles"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The modules of `miles` one import statement reads (`from a import b` reads module a.b if there is
    one, else module a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    else:
        return set()
    found = {_resolve(name, modules) for name in names if name == "miles" or name.startswith("miles.")}
    return {m for m in found if m is not None}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of `miles` a dotted name lives in (None: outside the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports (itself left out); parsed once for the tests that read it."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        targets = set().union(*(imported_modules(n, module, is_package, modules) for n in ast.walk(tree)))
        graph[module] = targets - {module}
    return graph


def read_layers() -> list[list[str]]:
    """Patterns of each layer, bottom (0) first, from the `## Layers` table of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1]
    table = re.search(r"```text\n(.*?)```", section, re.DOTALL).group(1)
    layers: dict[int, list[str]] = {}
    for line in table.splitlines():
        match = re.match(r"\s*(\d+)\s", line)
        if match:
            layers[int(match.group(1))] = [w for w in line.split() if w == "miles" or w.startswith("miles.")]
    assert sorted(layers) == list(range(len(layers))), f"layers must be numbered 0..n, got {sorted(layers)}"
    return [layers[i] for i in range(len(layers))]


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return fnmatch.fnmatchcase(module, pattern)


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    found = [i for i, patterns in enumerate(layers) if any(_matches(module, p) for p in patterns)]
    return found[0] if len(found) == 1 else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_two_files_import_each_other() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (break each; see docs/architecture.md, Layers):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_every_module_has_one_layer() -> None:
    layers = read_layers()
    unplaced = [m for m in all_modules() if layer_of(m, layers) is None]
    assert not unplaced, f"modules in no layer (or in several) of docs/architecture.md's Layers table: {unplaced}"


def test_no_import_points_up() -> None:
    layers = read_layers()
    upward = [
        f"{m} (layer {layer_of(m, layers)}) imports {t} (layer {layer_of(t, layers)})"
        for m, targets in sorted(import_graph().items())
        for t in sorted(targets)
        if (layer_of(t, layers) or 0) > (layer_of(m, layers) or 0)
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


# Rooms that share only the wire: the controller drives the workers through `miles.wire` (specs, RPC,
# codec) and the workers answer through it; neither imports the other, whatever the layers allow.
APART = [("miles.controller.*", "miles.workers.*")]


def imports_across(graph: dict[str, set[str]], apart: list[tuple[str, str]]) -> list[str]:
    """Each import from one side of a pair in `apart` into the other side, either way."""
    return [
        f"{m} imports {t}"
        for a, b in apart
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if (_matches(m, a) and _matches(t, b)) or (_matches(m, b) and _matches(t, a))
    ]


def test_controller_and_workers_never_import_each_other() -> None:
    found = imports_across(import_graph(), APART)
    assert not found, (
        "the controller and the workers talk only over miles.wire, never import each other:\n" + "\n".join(found)
    )


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The check itself: a planted cycle and a planted upward edge are reported."""
    graph = {"miles.a": {"miles.b"}, "miles.b": {"miles.c"}, "miles.c": {"miles.a"}, "miles.d": set()}
    assert cycles(graph) == [["miles.a", "miles.b", "miles.c"]]
    layers = [["miles.utils.*"], ["miles.controller.*"]]
    assert layer_of("miles.utils.timer", layers) == 0 and layer_of("miles.controller", layers) == 1
    assert layer_of("miles.controllers", layers) is None
    source = "from __future__ import annotations\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    node = ast.parse(source + "    from ..controller import run\n").body[-1].body[0]
    modules = {"miles.utils.timer": Path(), "miles.controller": Path(), "miles.controller.run": Path()}
    assert imported_modules(node, "miles.utils.timer", False, modules) == {"miles.controller.run"}
    node = ast.parse("from miles.controller import Runtime\n").body[0]
    assert imported_modules(node, "miles.utils.timer", False, modules) == {"miles.controller"}
    graph = {"miles.controller.run": {"miles.workers.main"}, "miles.workers.base": {"miles.controller"}}
    graph["miles.controller.loop"] = {"miles.wire.rpc", "miles.controller.run"}
    assert imports_across(graph, APART) == [
        "miles.controller.run imports miles.workers.main",
        "miles.workers.base imports miles.controller",
    ]
