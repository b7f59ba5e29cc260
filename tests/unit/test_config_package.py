"""The config package's own contracts: help groups are the YAML sections, a Literal field's choices are
written once and read by the parser and the start-up check, and docs/config.md is the docs command's output."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from miles.config import FIELDS, SECTIONS, ConfigError, build_parser, load_config
from miles.config.load import flatten_yaml
from miles.config.rules.values import ENUM_CHOICES

ROOT = Path(__file__).resolve().parents[2]
BASE = {"hf_checkpoint": "m", "prompt_data": "p.jsonl", "rm_type": "math", "rollout_batch_size": 2, "num_rollout": 1}


def _flag_groups() -> dict[str, list[argparse.Action]]:
    parser = build_parser()
    return {
        g.title: g._group_actions for g in parser._action_groups if g.title not in ("positional arguments", "options")
    }


def test_help_groups_are_the_yaml_sections_and_hold_their_fields():
    groups = _flag_groups()
    assert list(groups) == [section.rstrip("_") for section in SECTIONS]
    for title, actions in groups.items():
        assert actions, title
        for action in actions:
            assert FIELDS[action.dest].group == title, (action.dest, title)
            # the same field, nested under that section in YAML, is accepted there
            values, _ = flatten_yaml({title: {action.dest: FIELDS[action.dest].default}}, "test")
            assert action.dest in values
    listed = {a.dest for actions in groups.values() for a in actions}
    assert listed == {name for name, spec in FIELDS.items() if spec.cli}


def test_literal_choices_are_the_parsers_and_the_checks():
    hints = {name: hint for cls in SECTIONS.values() for name, hint in typing.get_type_hints(cls).items()}
    literal = {}
    for name, hint in hints.items():
        if typing.get_origin(hint) is not typing.Literal:  # `Literal[...] | None`
            hint = next((a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal), hint)
        if typing.get_origin(hint) is typing.Literal:
            literal[name] = typing.get_args(hint)
    assert literal and literal == ENUM_CHOICES
    actions = {a.dest: a for a in build_parser()._actions}
    for name, choices in literal.items():
        assert tuple(actions[name].choices) == choices
        assert all(choice in FIELDS[name].help for choice in choices), name  # `{choices}` rendered
        assert "{choices}" not in FIELDS[name].help


@pytest.mark.parametrize("name", ["engine", "wandb_mode", "use_session_server", "opd_top_k_strategy"])
def test_a_value_outside_the_literal_is_refused_alike_from_cli_and_yaml(name: str, tmp_path: Path):
    spec = FIELDS[name]
    bad = spec.choices[0] + "x"
    with pytest.raises(ConfigError) as cli:
        load_config([spec.flag, bad], base=BASE)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"{spec.group}:\n  {name}: {bad}\n")
    with pytest.raises(ConfigError) as from_yaml:
        load_config(["--config", str(yaml_file)], base=BASE)
    line = f"{spec.flag}={bad!r} is not one of {', '.join(spec.choices)} (did you mean {spec.choices[0]!r}?)"
    assert line in cli.value.errors and line in from_yaml.value.errors


def test_every_choice_is_accepted():
    for name, spec in FIELDS.items():
        for choice in spec.choices or ():
            try:
                cfg = load_config([spec.flag, choice], base=BASE)
            except ConfigError as e:  # other rules may refuse the mode; never the value itself
                assert not any("is not one of" in line for line in e.errors), (name, choice, e.errors)
            else:
                assert cfg.get(name) == choice


def test_docs_command_prints_docs_config_md():
    out = subprocess.run(
        [sys.executable, "-m", "miles.config.docs"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True
    ).stdout
    assert out == (ROOT / "docs" / "config.md").read_text(), "run `python -m miles.config.docs > docs/config.md`"
