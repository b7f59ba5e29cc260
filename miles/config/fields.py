"""Field specs of the config sections: flag names, types, help groups, value conversion.

`FIELDS` maps every field name (unique across sections) to its section, type, default and help
text; the parser, the YAML loader, the validators and the generated reference all read it.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any

from miles.config.sections import SECTIONS

# The order launch scripts group their arguments in; groups added later are appended.
GROUP_ORDER = ("MODEL", "CKPT", "ROLLOUT", "EVAL", "PERF", "GRPO", "OPTIMIZER", "LORA", "SGLANG", "RUNTIME", "LOGGING")
GROUP_DESCRIPTIONS = {
    "MODEL": "which model and how it is loaded",
    "CKPT": "reference / critic weights, saving and resuming",
    "ROLLOUT": "prompts, the batch knobs, sampling, rewards, filters, fully async",
    "EVAL": "evaluation data, cadence and sampling overrides",
    "PERF": "trainer layout and batching, offload, weight transfer",
    "GRPO": "the objective: advantages, clipping, KL, corrections",
    "OPTIMIZER": "learning rate schedule, AdamW, gradient clipping",
    "LORA": "low-rank adapters: rank, scale, dropout, which modules",
    "SGLANG": "rollout engines: kind, count, size, colocation; --sglang-* passthrough",
    "RUNTIME": "run directory, timeouts, profiling, debug modes",
    "LOGGING": "TensorBoard, Weights & Biases, progress bar",
}


class ConfigError(ValueError):
    """One or more configuration problems; the message lists all of them."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            text = f"config error: {self.errors[0]}"
        else:
            text = f"{len(self.errors)} config errors:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(text)


# ---------------------------------------------------------------- field specs


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    section: str
    base: type  # int, float, str, bool, list or dict
    elem: type | None  # element type of a list field
    optional: bool
    default: Any
    group: str
    help: str
    nargs: str | None
    cli: bool
    const: Any = None  # the value of a bare flag whose value is optional (nargs "?")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def type_name(self) -> str:
        if self.base is list:
            return f"list[{self.elem.__name__}]"
        return self.base.__name__


def _field_specs() -> dict[str, FieldSpec]:
    specs: dict[str, FieldSpec] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            hint, optional = hints[f.name], False
            if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
                args = [a for a in typing.get_args(hint) if a is not type(None)]
                optional, hint = True, args[0]
            origin = typing.get_origin(hint) or hint
            elem = (
                typing.get_args(hint)[0]
                if origin is list and typing.get_args(hint)
                else (str if origin is list else None)
            )
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if f.name in specs:
                raise TypeError(f"config field {f.name!r} is defined in both {specs[f.name].section} and {section}")
            specs[f.name] = FieldSpec(
                name=f.name,
                section=section,
                base=origin,
                elem=elem,
                optional=optional,
                default=default,
                group=f.metadata.get("group", "OTHER"),
                help=f.metadata.get("help", ""),
                nargs=f.metadata.get("nargs", "*" if origin is list else None),
                cli=f.metadata.get("cli", True),
                const=f.metadata.get("const"),
            )
    return specs


FIELDS: dict[str, FieldSpec] = _field_specs()


def groups() -> dict[str, list[FieldSpec]]:
    """Fields by help group, groups in launch-script order."""
    out: dict[str, list[FieldSpec]] = {g: [] for g in GROUP_ORDER}
    for spec in FIELDS.values():
        out.setdefault(spec.group, []).append(spec)
    return {g: specs for g, specs in out.items() if specs}


# ---------------------------------------------------------------- value conversion

_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _convert_scalar(kind: type, raw: Any) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ValueError
    if kind is int:
        if isinstance(raw, bool):
            raise ValueError
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        return int(raw) if isinstance(raw, (int, str)) else _fail()
    if kind is float:
        if isinstance(raw, bool):
            raise ValueError
        return float(raw) if isinstance(raw, (int, float, str)) else _fail()
    if kind is str:
        return str(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else _fail()
    if kind is dict:
        return dict(raw) if isinstance(raw, dict) else _fail()
    raise ValueError


def _fail() -> Any:
    raise ValueError


def convert(spec: FieldSpec, raw: Any, source: str) -> Any:
    """Coerce a YAML or command-line value to the field's type; ConfigError names the source."""
    if spec.const is not None and isinstance(raw, bool):  # YAML `flag: true` is the bare flag
        return spec.const if raw else None
    if raw is None or (spec.optional and isinstance(raw, str) and raw.lower() in ("none", "null")):
        if spec.optional:
            return None
        raise ConfigError(
            f"{source}: {spec.name} cannot be empty (expected {spec.type_name}, default {spec.default!r})"
        )
    try:
        if spec.base is list:
            items = raw if isinstance(raw, (list, tuple)) else [raw]
            if spec.elem in (int, float):  # numbers also come comma separated: --profile-steps 3,4
                items = [p for x in items for p in (x.split(",") if isinstance(x, str) else [x]) if p != ""]
            return [_convert_scalar(spec.elem, x) for x in items]
        return _convert_scalar(spec.base, raw)
    except (ValueError, TypeError):
        raise ConfigError(f"{source}: {spec.name} expects {spec.type_name}, got {raw!r}") from None


def parse_scalar(text: str) -> Any:
    """Best-effort typing of a passthrough value: int, float, bool, else the string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def closest_flag(flag: str) -> str | None:
    candidates = [s.flag for s in FIELDS.values() if s.cli] + ["--config"]
    match = difflib.get_close_matches(flag, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_flag_message(flag: str, where: str = "") -> str:
    near = closest_flag(flag)
    hint = f"; closest valid flag: {near}" if near else "; see `miles train --help` for valid flags"
    return f"unknown flag {flag}{where}{hint}"


# ---------------------------------------------------------------- reference


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "." if text else ""


def _range_cell(name: str) -> str:
    from miles.config.ranges import NUMBER_RANGES

    return f"`{NUMBER_RANGES[name][0]}`" if name in NUMBER_RANGES else ""


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def render_markdown() -> str:
    """The configuration reference (docs/config.md is this output)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `miles/config_sections.py` by `miles config --markdown > docs/config.md`; edit the",
        "dataclasses, not this file.",
        "",
        "Every field is a command-line flag and a YAML key. In YAML a key may be the flag name",
        "(`rollout-batch-size: 8`), the field name (`rollout_batch_size: 8`), or nested under its section",
        "(`rollout: {rollout_batch_size: 8}`). Booleans take `--flag` / `--no-flag`; list flags take several",
        "values. Flags given on the command line override the file given with `--config`. A numeric flag",
        "outside its range (`[`/`]` include the bound, `(`/`)` exclude it) is refused at start-up. Any other",
        "`--sglang-<name> VALUE` flag is passed through to `sglang.launch_server --<name> VALUE`",
        "(kept in `engine.sglang_args`; in YAML under `sglang:`). The embedded engine reads four of them as",
        "SGLang does, `--sglang-disable-cuda-graph`, `--sglang-disable-radix-cache` (prefix sharing off),",
        "`--sglang-quantization fp8` and `--sglang-dtype` (what the engines compute in and",
        "weights travel in; default `--dtype`), and refuses any other.",
        "",
        "The batch knobs obey `rollout_batch_size × n_samples_per_prompt = global_batch_size ×",
        "num_steps_per_rollout`: give any three and the fourth is derived (see docs/concepts.md).",
        "",
    ]
    for group, specs in groups().items():
        lines += [
            f"## {group}",
            "",
            _sentence(GROUP_DESCRIPTIONS.get(group, "")),
            "",
            "| flag | section | type | default | range | description |",
            "|---|---|---|---|---|---|",
        ]
        for spec in specs:
            flag = f"`{spec.flag}`" if spec.cli else f"`{spec.name}` (YAML only)"
            type_name = spec.type_name + (" or None" if spec.optional else "")
            lines.append(
                f"| {flag} | {spec.section.rstrip('_')} | {type_name} | `{_md(repr(spec.default))}` "
                f"| {_range_cell(spec.name)} | {_md(spec.help)} |"
            )
        lines.append("")
    return "\n".join(lines)
