"""Generated and quoted documentation matches the code."""

from __future__ import annotations

import re
from pathlib import Path

from miles.config.docs import render_markdown

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


def test_readme_layout_names_every_part_of_the_package():
    layout = next(b for b in fenced_blocks((ROOT / "README.md").read_text()) if b.startswith("miles/"))
    named = set(re.findall(r"[\w.]+/?", layout))
    parts = [
        p.name + "/" if p.is_dir() else p.name
        for p in sorted((ROOT / "miles").iterdir())
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    ]
    missing = [p for p in parts if p not in named]
    assert parts and not missing, f"README's layout block lacks these parts of miles/: {missing}"


def test_evidence_rows_link_to_their_details():
    rows = [line for line in (ROOT / "docs" / "evidence.md").read_text().splitlines() if line.startswith("| ")][2:]
    details = (ROOT / "docs" / "evidence_details.md").read_text()
    anchors = [re.search(r"evidence_details\.md#([\w-]+)", row) for row in rows]
    assert rows and all(anchors), "every evidence row links to its details"
    missing = [a.group(1) for a in anchors if f'<a id="{a.group(1)}"></a>' not in details]
    assert not missing, f"evidence_details.md lacks the anchors {missing}"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_quickstart_sweep_example_is_valid_at_every_point(tmp_path, monkeypatch):
    from miles.sweep import invalid_points, load_sweep

    block = next(b for b in fenced_blocks((ROOT / "docs" / "quickstart.md").read_text()) if b.startswith("# lr-sweep"))
    (tmp_path / "lr-sweep.yaml").write_text(block)
    monkeypatch.chdir(ROOT)
    sweep = load_sweep(tmp_path / "lr-sweep.yaml")
    assert len(sweep.points) == 6
    assert invalid_points(sweep) == {}
    # the check is real: the grid over n-samples-per-prompt the quickstart warns about fails at 4
    bad_grid = block.replace("rollout-temperature: [0.8, 1.0]", "n-samples-per-prompt: [4, 8]")
    (tmp_path / "bad.yaml").write_text(bad_grid)
    assert sorted(invalid_points(load_sweep(tmp_path / "bad.yaml"))) == [0, 2, 4]


def test_quickstart_config_errors_happen_as_shown():
    import subprocess
    import sys

    for block in fenced_blocks((ROOT / "docs" / "quickstart.md").read_text()):
        if not block.startswith("$ miles train"):
            continue
        command, *expected = block.splitlines()
        args = command.removeprefix("$ miles train ").split()
        proc = subprocess.run(
            [sys.executable, "-m", "miles.cli", "train", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines()[-len(expected) :] == expected
