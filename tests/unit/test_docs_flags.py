"""The commands the documentation and the recorded results print use flags that exist: every `--flag` after
`miles train` is one of its flags, and every one after `bench/NAME.py` is that bench's or (passed through) a
`miles train` flag. A renamed flag otherwise leaves a page whose commands fail."""

from __future__ import annotations

import re
from pathlib import Path

from miles.config.load import build_parser

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench" / "results").glob("*.md")])
# what the pages show on purpose: a placeholder, and a misspelt flag next to the error it gets
NOT_FLAGS = {("README.md", "--flag"), ("quickstart.md", "--n-sample-per-prompt")}
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# `--miles-extra "--x y"`, `--extra '...'`: another program's flags (a quote the line leaves open runs to its end)
QUOTED = re.compile(r"\"[^\"]*(\"|$)|'[^']*('|$)")


def _train_flags() -> set[str]:
    return {s for action in build_parser()._actions for s in action.option_strings}


def _bench_flags(name: str) -> set[str] | None:
    path = REPO / "bench" / f"{name}.py"
    if not path.is_file():
        return None
    src = path.read_text()
    named = set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", src))
    looped = {f"--{m}" for m in re.findall(r"\(\"([a-z][a-z0-9-]*)\", ", src)}  # for name, default in (("x", 1), ...)
    return named | looped | {"--help"}


def _commands(pattern: str) -> list[tuple[str, str, str]]:
    """(page, program, its arguments) for every command line matching `pattern` (continuations joined)."""
    found = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for m in re.finditer(pattern + r"([^`\n;&|)]*)", text):
            found.append((page.name, m.group(1), m.group(2)))
    return found


def test_miles_train_commands_use_its_flags():
    known = _train_flags()
    commands = _commands(r"miles (train)\b")
    assert len(commands) > 50  # the pages are read
    unknown = {
        (page, flag)
        for page, _, args in commands
        for flag in FLAG.findall(QUOTED.sub(" ", args))
        if flag not in known and not flag.startswith("--sglang-") and (page, flag) not in NOT_FLAGS
    }
    assert not unknown, f"pages name flags `miles train` does not have: {sorted(unknown)}"


def test_bench_commands_use_the_benches_flags():
    train = _train_flags()
    commands = _commands(r"bench/([a-z_0-9]+)\.py\b")
    assert len(commands) > 30
    problems = set()
    for page, name, args in commands:
        flags = _bench_flags(name)
        if flags is None:
            problems.add((page, f"bench/{name}.py does not exist"))
            continue
        for flag in FLAG.findall(QUOTED.sub(" ", args)):
            if flag not in flags and flag not in train:
                problems.add((page, f"bench/{name}.py {flag}"))
    assert not problems, f"pages name benches or bench flags that do not exist: {sorted(problems)}"
