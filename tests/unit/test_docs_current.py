"""Generated and quoted documentation matches the code."""

from __future__ import annotations

import re
from pathlib import Path

from miles.config import render_markdown

ROOT = Path(__file__).resolve().parents[2]


def fenced_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"```[a-z]*\n(.*?)```", text, re.DOTALL)]


def test_config_reference_is_current():
    on_disk = (ROOT / "docs" / "config.md").read_text()
    assert on_disk == render_markdown(), "docs/config.md is stale: run `miles config --markdown > docs/config.md`"


def test_readme_starts_with_two_one_line_setup_commands():
    blocks = fenced_blocks((ROOT / "README.md").read_text())
    demo, tests = blocks[0], blocks[1]
    assert "\n" not in demo and "\n" not in tests
    assert demo.startswith("pip install torch==") and demo.endswith(
        "miles train --config launch/configs/demo_cpu.yaml"
    )
    assert tests.startswith("pip install torch==") and tests.endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command_verbatim():
    tests = fenced_blocks((ROOT / "README.md").read_text())[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
