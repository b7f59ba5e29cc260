"""YAML + command line -> `MilesConfig`.

Every field of the sections in `miles/config/sections/` is a flag (`rollout_batch_size` ->
`--rollout-batch-size`) and a YAML key (flat, with dashes or underscores, or nested under its
section). The command line wins over the YAML file. Unknown `--sglang-*` flags are kept in
`engine.sglang_args` for `sglang.launch_server`. After parsing, `miles.config.checks` derives
the four-knob invariant and the defaults that depend on other flags, and collects every
invalid combination into one `ConfigError`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import yaml

from miles.config.checks import finalize
from miles.config.fields import (
    FIELDS,
    ConfigError,
    FieldSpec,
    convert,
    groups,
    parse_scalar,
    section_description,
    unknown_flag_message,
)
from miles.config.ranges import NUMBER_RANGES
from miles.config.sections import SECTIONS, MilesConfig

logger = logging.getLogger(__name__)

SGLANG_PREFIX = "--sglang-"


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """argparse with the choices of a Literal field on its action (for --help and completion), checked
    after parsing by `miles.config.rules.values.check_enums`, so that the command line and the YAML get the
    same one-line refusal with the closest choice, listed beside every other problem."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        return None


def _help_text(spec: FieldSpec) -> str:
    text = spec.help if "default" in spec.help else f"{spec.help} (default: {spec.default!r})"
    if spec.name in NUMBER_RANGES:
        text += f" [range {NUMBER_RANGES[spec.name][0]}]"
    return text.replace("%", "%%")  # argparse %-formats help


def _add_flag(group: argparse._ArgumentGroup, spec: FieldSpec) -> None:
    common = {"dest": spec.name, "default": argparse.SUPPRESS, "help": _help_text(spec)}
    if spec.base is bool:
        group.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **common)
    elif spec.const is not None:  # `--flag` alone means `const`, `--flag VALUE` picks another
        group.add_argument(spec.flag, nargs="?", const=spec.const, choices=spec.choices, **common)
    else:
        metavar = spec.elem.__name__.upper() if spec.base is list else spec.base.__name__.upper()
        group.add_argument(spec.flag, nargs=spec.nargs, metavar=metavar, choices=spec.choices, **common)


def build_parser(prog: str = "miles train") -> argparse.ArgumentParser:
    """`miles train`'s parser: one help group per config section, titled with its YAML section name."""
    parser = _Parser(
        prog=prog,
        usage=f"{prog} [--config FILE] [--flag VALUE ...] [--sglang-<name> VALUE ...]",
        description="Train with RL. Flags override the YAML file given with --config; "
        "unknown --sglang-* flags are passed to sglang.launch_server.",
        allow_abbrev=False,
        exit_on_error=False,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        help="YAML file of flags (flat or nested by section); one file: a second --config is refused",
    )
    for group, specs in groups().items():
        arg_group = parser.add_argument_group(group, section_description(group))
        for spec in specs:
            if spec.cli:
                _add_flag(arg_group, spec)
    return parser


def split_sglang_passthrough(argv: list[str], known: set[str]) -> tuple[list[str], dict[str, Any]]:
    """Pull `--sglang-<x> [VALUE]` flags Miles does not own out of argv."""
    rest: list[str] = []
    passthrough: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if token.startswith(SGLANG_PREFIX) and name not in known:
            key = name[len(SGLANG_PREFIX) :].replace("-", "_")
            if eq:
                passthrough[key] = parse_scalar(inline)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                passthrough[key] = parse_scalar(argv[i + 1])
                i += 1
            else:
                passthrough[key] = True
        else:
            rest.append(token)
        i += 1
    return rest, passthrough


def parse_cli(argv: list[str], prog: str = "miles train") -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """-> (config file, {field: raw value} of the flags given, sglang passthrough)."""
    parser = build_parser(prog)
    argv, passthrough = split_sglang_passthrough(list(argv), set(parser._option_string_actions))
    try:
        namespace, extras = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None
    errors, i = [], 0
    while i < len(extras):
        token = extras[i]
        if token.startswith("-"):
            errors.append(unknown_flag_message(token.partition("=")[0]))
            if i + 1 < len(extras) and not extras[i + 1].startswith("-"):
                i += 1  # the unknown flag's value
        else:
            errors.append(f"unexpected argument {token!r}; settings are given as --flag value")
        i += 1
    if errors:
        raise ConfigError(errors)
    given = vars(namespace)
    config_paths = given.pop("config", None) or []
    if len(config_paths) > 1:
        raise ConfigError(
            f"--config given {len(config_paths)} times ({', '.join(config_paths)}); give one file (merge the others "
            "into it) and override single settings with flags on the command line"
        )
    return (config_paths[0] if config_paths else None), given, passthrough


# ---------------------------------------------------------------- YAML


def _key_to_field(key: str) -> str:
    return str(key).lstrip("-").replace("-", "_")


def flatten_yaml(data: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """YAML mapping (flat and/or nested by section) -> ({field: raw value}, sglang passthrough)."""
    values: dict[str, Any] = {}
    passthrough: dict[str, Any] = {}
    errors: list[str] = []
    section_names = {s.rstrip("_"): s for s in SECTIONS} | {s: s for s in SECTIONS}

    set_by: dict[str, str] = {}

    def take(key: str, value: Any, section: str | None) -> None:
        name = _key_to_field(key)
        where = f"{section.rstrip('_')}.{key}" if section else str(key)
        if name in set_by:  # `lr` and `optim: {lr}`, or `rollout-batch-size` and `rollout_batch_size`
            errors.append(f"{source}: key {where!r} sets {name} again (already set by {set_by[name]!r}); keep one")
            return
        set_by[name] = where
        if name == "sglang_args" and isinstance(value, dict):
            passthrough.update({_key_to_field(k): v for k, v in value.items()})
        elif name in FIELDS:
            owner = FIELDS[name].section
            if section is not None and owner != section:
                errors.append(
                    f"{source}: key {key!r} is under section {section!r} but belongs to {owner.rstrip('_')!r}"
                )
            else:
                values[name] = value
        elif name.startswith("sglang_"):
            passthrough[name[len("sglang_") :]] = value
        else:
            errors.append(unknown_flag_message("--" + name.replace("_", "-"), f" (key {key!r} in {source})"))

    for key, value in data.items():
        name = _key_to_field(key)
        if name in section_names and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                take(sub_key, sub_value, section_names[name])
        elif name == "sglang" and isinstance(value, dict):
            passthrough.update({_key_to_field(k): v for k, v in value.items()})
        else:
            take(key, value, None)
    if errors:
        raise ConfigError(errors)
    return values, passthrough


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (YAML would keep the last one silently)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKey(f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except DuplicateKey as e:
        raise ConfigError(f"--config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag: value, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------- assembly


def build_config(values: dict[str, Any], sglang_args: dict[str, Any]) -> MilesConfig:
    """Typed sections from already-merged raw values (no derivation, no validation)."""
    cfg = MilesConfig()
    for name, raw in values.items():
        spec = FIELDS[name]
        cfg.set(name, convert(spec, raw, spec.flag))
    cfg.engine.sglang_args = dict(sglang_args)
    return cfg


def load_config(argv: list[str], *, base: dict[str, Any] | None = None, for_train: bool = True) -> MilesConfig:
    """Parse `miles train` arguments: defaults < `base` mapping < `--config` YAML < command line.

    `for_train` adds the checks that only a training run needs (model, data, reward, length).
    Raises ConfigError listing every problem found.
    """
    config_path, cli_values, cli_sglang = parse_cli(argv)
    values: dict[str, Any] = {}
    sglang: dict[str, Any] = {}
    layers = [(base or {}, "base mapping")]
    if config_path:
        layers.append((read_yaml(config_path), f"--config {config_path}"))
    for data, source in layers:
        layer_values, layer_sglang = flatten_yaml(data, source)
        for name, raw in layer_values.items():
            values[name] = convert(FIELDS[name], raw, f"{source}: {name}")
        sglang.update(layer_sglang)
    values.update(cli_values)
    sglang.update(cli_sglang)
    cfg = build_config(values, sglang)
    explicit = {name for name, raw in values.items() if raw is not None}
    finalize(cfg, explicit, for_train=for_train)
    logger.debug("config resolved: %s", cfg.to_dict())
    return cfg


def save_config(cfg: MilesConfig, path: str | Path) -> None:
    """Write the resolved config as nested YAML (readable back with --config)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
