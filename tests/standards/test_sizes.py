"""Room sizes: no module of `miles/`, `bench/` or `launch/` past 500 lines (a module that grows past ~400
is two ideas, split at the seam before 500) and no function past 80 lines. Tests are left out: a test file
is a list of cases, not a room."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("miles", "bench", "launch")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    return sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py"))


def long_functions(path: Path, limit: int, root: Path = ROOT) -> list[str]:
    """`path:line name (N lines)` for every function or method of the file longer than `limit` lines,
    decorators left out, its docstring and nested functions counted in; `path` named relative to `root`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_rooms_hold_python_files():
    assert len(python_files()) > 100  # the globs still find the tree (a moved root would pass vacuously)


def test_no_module_is_past_500_lines():
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in python_files()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"split these at their seams: {long}"


def test_no_function_is_past_80_lines():
    long = [entry for p in python_files() for entry in long_functions(p, MAX_FUNCTION_LINES)]
    assert not long, f"break these into named steps: {long}"


def test_the_function_check_counts_lines(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(80))  # with its def line, 81 lines
    (tmp_path / "f.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "f.py", 79, root=tmp_path) == ["f.py:5 long (81 lines)"]
    assert long_functions(tmp_path / "f.py", 81, root=tmp_path) == []
